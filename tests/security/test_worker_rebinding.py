"""The gateway dials only addresses it checked: a worker's name is resolved at every new
connection, each answer checked like a registration (`--allowed-worker-networks` included), and
the address checked is the one connected to, under the name's Host header. The controller's
side (its polls of a name that rebinds) is in test_worker_registration.py."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import openai
import pytest
from fastapi import FastAPI, Request

from llmplatform.openai_api.worker_stream import WorkerStreamClient
from llmplatform.openai_api.worker_wire import WorkerUnavailableError
from llmplatform.utils.server import serve_in_thread
from tests.fake_worker import MODEL, make_fake_worker, register_worker
from tests.faults.harness import controller_app, services, start_service
from tests.integration.cluster import wait_for_models
from tests.processes import free_port


def _echo_host() -> FastAPI:
    app = FastAPI()

    @app.post("/worker_generate_stream")
    async def generate(request: Request) -> dict[str, str]:
        return {"host": request.headers["host"]}

    return app


def test_a_name_that_rebinds_is_not_dialled_at_its_new_address() -> None:
    answers = {"worker.internal": ["127.0.0.1"]}
    asked: list[str] = []

    async def resolve(host: str) -> list[str]:
        asked.append(host)
        return answers[host]

    async def scenario(port: int) -> tuple[bytes, str]:
        client = WorkerStreamClient(headers={}, connect_timeout=5, read_timeout=10,
                                    max_connections=4, resolve=resolve)
        url = f"http://worker.internal:{port}/worker_generate_stream"
        try:
            async with client.stream(url, {}) as body:
                first = b"".join([chunk async for chunk in body])
            await client.aclose()  # no pooled connection: the next request dials again
            client = WorkerStreamClient(headers={}, connect_timeout=5, read_timeout=10,
                                        max_connections=4, resolve=resolve)
            answers["worker.internal"] = ["169.254.169.254"]
            with pytest.raises(WorkerUnavailableError) as refused:
                async with client.stream(url, {}):
                    pass
            return first, refused.value.message
        finally:
            await client.aclose()

    with serve_in_thread(_echo_host()) as worker:
        port = int(worker.rsplit(":", 1)[1])
        first, refusal = asyncio.run(scenario(port))
    assert first == f'{{"host":"worker.internal:{port}"}}'.encode()  # dialled 127.0.0.1, Host kept
    assert "169.254.169.254" in refusal and "not dialled" in refusal, refusal
    assert asked == ["worker.internal", "worker.internal"]


@pytest.mark.parametrize("networks", ["10.0.0.0/8", "127.0.0.0/8"], ids=["outside", "inside"])
def test_the_gateway_checks_a_workers_name_against_its_allow_list(tmp_path: Path, networks: str) -> None:
    """A worker the controller accepted as http://localhost:PORT (no allow-list there) is not
    dialled by a gateway whose --allowed-worker-networks leaves loopback out (503, the worker
    never sees the prompt), and is served by one whose list holds loopback."""
    inner, state = make_fake_worker([MODEL])
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        worker = stack.enter_context(serve_in_thread(inner))
        register_worker(controller, worker.replace("127.0.0.1", "localhost"), [MODEL])
        wait_for_models(controller, [MODEL])
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gateway = start_service("llmplatform.openai_api",
                                ["--port", str(port), "--controller-address", controller,
                                 "--max-worker-attempts", "1", "--allowed-worker-networks", networks],
                                tmp_path / "gateway.log", f"{url}/health", url)
        stack.enter_context(services(gateway))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "Hi"}]
        if networks == "127.0.0.0/8":
            assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages).choices
            assert len(state.params) == 1
            return
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
        assert caught.value.status_code == 503, caught.value
        # Its first call (model details, on the httpx client) is refused before connecting.
        assert "localhost" in str(caught.value.body), caught.value.body
        assert state.params == [], "the worker received the prompt"
