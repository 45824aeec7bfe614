"""least_load with two real paged workers of unequal load and unequal capacity.

Worker A batches 16 sequences, worker B 2. Load is held with real long streams (ignore_eos, a
long context) that stay open until the test closes them. The controller must route by the
share of capacity in use that heartbeats report, not by raw queue length (shortest_queue would
pick B whenever B's queue is shorter), both for `/get_worker_address` and for requests sent
through the gateway with the official client (which routes from its own copy of the controller's
worker list, ranked with the controller's method and load facts).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.routing.policies import DispatchMethod
from llmplatform.controller.registry import WorkerInfo, WorkerRegistry
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.server import serve_in_thread
from tests.polling import wait_until

MODEL = "tiny"
LONG_CONTEXT = 65536
# Far more than the test lasts: the streams only end when the test closes them.
LONG_OUTPUT = 60000


@pytest.fixture(scope="module")
def long_context_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a long context, so a stream can outlast the test."""
    out = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    return out


@contextlib.contextmanager
def direct_stream(client: httpx.Client, worker_url: str) -> Iterator[None]:
    """A long generation sent straight to one worker (no dispatch), open until exit."""
    params = {"model": MODEL, "prompt": "Hello there", "max_new_tokens": LONG_OUTPUT,
              "temperature": 0.0, "echo": False, "ignore_eos": True}
    with client.stream("POST", f"{worker_url}/worker_generate_stream", json=params) as response:
        assert response.status_code == 200
        # Keep the iterator referenced: a collected one closes the response (and the worker
        # would abort the request).
        chunks = response.iter_bytes()
        next(chunks)  # generation has started
        yield
        del chunks


def worker_running(worker_url: str) -> int:
    return httpx.post(f"{worker_url}/worker_get_status", timeout=5).json()["num_running"]


def test_requests_go_to_the_worker_with_the_smaller_share_of_capacity(
    long_context_model: Path,
) -> None:
    controller_app = create_controller_app(ControllerConfig(dispatch_method=DispatchMethod.LEAST_LOAD))
    registry: WorkerRegistry = controller_app.state.registry

    def entry(url: str) -> WorkerInfo:
        info = registry.get(url)
        assert info is not None
        return info

    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app))
        gateway_app = create_gateway_app(GatewaySettings(controller_address=controller,
                                                         worker_refresh_interval=0.2))
        gateway = stack.enter_context(serve_in_thread(gateway_app))

        def gateway_sees(url: str, num_running: int) -> bool:
            """Whether the gateway's last read of the worker list shows `url` running that many."""
            return any(w.worker_name == url and w.num_running == num_running
                       for w in gateway_app.state.routing_table.workers())

        urls = []
        for max_num_seqs in (16, 2):
            llm = build_backend(BackendConfig(model_path=str(long_context_model), model_names=(MODEL,),
                                          backend="paged", dtype="float32",
                                          max_num_seqs=max_num_seqs, kv_cache_memory="64MiB"))
            app = create_worker_app(llm, WorkerSettings(
                worker_address=None, controller_address=controller,
                limit_worker_concurrency=llm.default_concurrency, heartbeat_interval=0.2))
            url = stack.enter_context(serve_in_thread(app))
            app.state.worker_address = url
            urls.append(url)
        a, b = urls
        wait_until(lambda: a in registry and b in registry, what="both workers to register",
                   context=registry.live_workers)
        assert (entry(a).max_num_running, entry(b).max_num_running) == (16, 2)

        client = stack.enter_context(httpx.Client(timeout=60))

        def address() -> str:
            response = client.post(f"{controller}/get_worker_address", json={"model": MODEL})
            return response.json()["address"]

        # A runs 3 of 16, B nothing: the idle worker gets the request.
        for _ in range(3):
            stack.enter_context(direct_stream(client, a))
        wait_until(lambda: entry(a).num_running == 3, what="A's heartbeat to report 3 running",
                   context=registry.live_workers)
        assert address() == b

        # B runs 1 of 2 (1/2) while A runs 3 of 16 (3/16): A is the lighter one although its
        # queue is longer. Two picks in a row (A at 4/16 after the first) both go to A.
        stack.enter_context(direct_stream(client, b))
        wait_until(lambda: entry(b).num_running == 1, what="B's heartbeat to report 1 running",
                   context=registry.live_workers)
        assert [address(), address()] == [a, a]

        # Through the gateway, with the official client: two more streams, both on A
        # (at most 7/16 < 1/2 even if no heartbeat came in between), once the gateway's copy
        # of the worker list shows what the controller's registry shows.
        wait_until(lambda: gateway_sees(a, 3) and gateway_sees(b, 1),
                   what="the gateway to read A's 3 and B's 1 running",
                   context=gateway_app.state.routing_table.workers)
        api = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)
        for _ in range(2):
            stream = api.completions.create(model=MODEL, prompt="Hi", max_tokens=LONG_OUTPUT,
                                            temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
            stack.callback(stream.close)
            next(iter(stream))  # the gateway has picked a worker and generation started
        wait_until(lambda: worker_running(a) == 5, what="A to run the two gateway streams",
                   context=lambda: (worker_running(a), worker_running(b)))
        assert worker_running(b) == 1
