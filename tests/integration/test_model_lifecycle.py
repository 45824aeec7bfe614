"""Models launched, stopped and started on demand at runtime, through real processes: a controller,
a gateway and a host agent on real uvicorn servers (127.0.0.1, ephemeral ports), workers started by
the agent as real `python -m llmplatform.model_worker` processes, the official `openai` client."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.worker_routing import update_from_listing
from llmplatform.protocol.controller import ListWorkersResponse
from llmplatform.serve.agent import AgentConfig
from llmplatform.serve.agent import create_app as create_agent_app
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.polling import wait_until
from tests.processes import alive, children_of, free_port

ADMIN, USER = "admin-key", "user-key"
WORKER_ARGS = ["--dtype", "float32", "--device", "cpu", "--heartbeat-interval", "0.5"]
LOAD_TIMEOUT_S = 180


@dataclass
class Runtime:
    gateway_url: str
    agent_app: Any
    restart_controller: Callable[[], None]
    controller_url: str
    gateway_app: Any

    def admin(self, method: str, path: str, key: str | None = ADMIN, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, f"{self.gateway_url}/v1/admin{path}", headers=headers,
                             timeout=60, **kwargs)

    def states(self) -> dict[str, dict]:
        response = self.admin("GET", "/models")
        assert response.status_code == 200, response.text
        return {m["name"]: m for m in response.json()["data"]}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway_url}/v1", api_key=USER, max_retries=0,
                             timeout=120)

    def wait_state(self, name: str, *states: str | None) -> dict | None:
        def reached() -> tuple[dict | None] | None:
            model = self.states().get(name)
            state = None if model is None else model["state"]
            assert state != "failed" or "failed" in states, model
            return (model,) if state in states else None

        return wait_until(reached, timeout_s=LOAD_TIMEOUT_S, interval_s=0.25,
                          what=f"{name} to be {states}")[0]

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.agent_app.state.processes.listing()]


def launch_body(model_dir: Path, name: str, **extra: Any) -> dict:
    return {"name": name, "model_path": str(model_dir), "backend": "paged",
            "kv_cache_memory": "64MiB", "worker_args": WORKER_ARGS, **extra}


@contextlib.contextmanager
def runtime(tmp_path: Path, *, memory_limit_bytes: int | None = None,
            first_model_dir: Path | None = None, worker_refresh_interval: float = 0.5
            ) -> Iterator[Runtime]:
    with contextlib.ExitStack() as stack:
        port = free_port()  # a restarted controller comes back at the same address
        controller = [contextlib.ExitStack()]
        stack.callback(lambda: controller[0].close())  # last: the others talk to it

        def start_controller() -> str:
            return controller[0].enter_context(serve_in_thread(create_controller_app(
                ControllerConfig(heartbeat_expiration=10.0, model_load_timeout=LOAD_TIMEOUT_S)),
                port=port))

        def restart_controller() -> None:
            controller[0].close()
            controller[0] = contextlib.ExitStack()
            start_controller()

        controller_url = start_controller()
        agent_app = create_agent_app(AgentConfig(
            controller_address=controller_url, log_dir=tmp_path / "logs",
            memory_limit_bytes=memory_limit_bytes, worker_shutdown_timeout=120.0,
            register_interval=0.5))
        agent_url = stack.enter_context(serve_in_thread(agent_app))
        agent_app.state.agent_address = agent_url
        gateway_app = create_gateway_app(GatewaySettings(
            controller_address=controller_url, api_keys=(USER,), admin_api_keys=(ADMIN,),
            worker_refresh_interval=worker_refresh_interval, on_demand_timeout=LOAD_TIMEOUT_S))
        gateway_url = stack.enter_context(serve_in_thread(gateway_app))
        if first_model_dir is not None:  # a model served by a worker started some other way
            from llmplatform.model_worker.app import WorkerSettings
            from llmplatform.model_worker.app import create_app as create_worker_app

            llm = paged_tiny_llm(first_model_dir)
            app = create_worker_app(llm, WorkerSettings(
                worker_address=None, controller_address=controller_url, heartbeat_interval=0.5,
                limit_worker_concurrency=llm.default_concurrency))
            app.state.worker_address = stack.enter_context(serve_in_thread(app))
            wait_for_models(controller_url, ["tiny"])
        rt = Runtime(gateway_url, agent_app, restart_controller, controller_url, gateway_app)
        wait_until(lambda: rt.admin("GET", "/models").json()["hosts"], interval_s=0.1,
                   what="the agent to register")
        yield rt
    assert not [pid for pid in children_of(os.getpid())
                if alive(pid) and b"llmplatform.model_worker" in _cmdline(pid)], "a worker outlived its test"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def chat(client: openai.OpenAI, model: str, max_tokens: int = 4) -> str | None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=max_tokens)
    return reply.choices[0].finish_reason


def test_launch_beside_traffic_then_stop_during_a_stream(tmp_path, tiny_model_dir):
    with runtime(tmp_path, first_model_dir=tiny_model_dir) as rt:
        client = rt.client()
        failures: list[BaseException] = []
        served = [0]
        done = threading.Event()

        def traffic() -> None:
            while not done.is_set():
                try:
                    assert chat(client, "tiny") is not None
                    served[0] += 1
                    done.wait(0.05)  # steady traffic, not all of the two CPUs
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    failures.append(exc)

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            response = rt.admin("POST", "/models", json=launch_body(tiny_model_dir, "tiny2"))
            assert response.status_code == 202, response.text
            assert response.json()["state"] == "loading"
            ready = rt.wait_state("tiny2", "ready")
            assert ready["managed"] and len(ready["workers"]) == 1
            assert chat(client, "tiny2") is not None
            assert rt.states()["tiny"]["managed"] is False  # listed, not stoppable here

            # A stream running on tiny2 when it is stopped still finishes. (The tiny model on
            # the CPU takes far longer for 128 tokens than the stop takes to reach its worker.)
            stream = client.chat.completions.create(
                model="tiny2", messages=[{"role": "user", "content": "Hi"}], max_tokens=128,
                stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            assert next(chunks).choices[0].delta is not None
            response = rt.admin("DELETE", "/models/tiny2")
            assert response.status_code == 202, response.text
            assert response.json()["state"] == "draining"
            assert rt.states()["tiny2"]["state"] == "draining"  # until its worker has exited
            with pytest.raises(openai.APIStatusError) as refused:
                chat(client, "tiny2")  # nothing new is routed to it
            assert refused.value.status_code == 503
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finishes[-1] == "length"
            # The worker's own log: told to stop, it finished the stream, then exited.
            [log] = (tmp_path / "logs").glob("worker-tiny2-*.log")
            lines = log.read_text().splitlines()
            stopping = next(i for i, line in enumerate(lines) if "Shutting down" in line)
            assert any("completion_tokens=128" in line for line in lines[stopping:]), lines[-8:]
            rt.wait_state("tiny2", None)  # gone from the listing once stopped
            assert rt.worker_pids() == []
        finally:
            done.set()
            thread.join()
        assert failures == [] and served[0] > 0


def test_bad_launches_are_refused_and_change_nothing(tmp_path, tiny_model_dir):
    with runtime(tmp_path, memory_limit_bytes=1 << 30) as rt:
        refused = [
            ({**launch_body(tiny_model_dir, "m"), "model_path": str(tmp_path / "nowhere")}, 400,
             "not a checkpoint"),
            ({**launch_body(tiny_model_dir, "m"), "worker_args": ["--no-such-flag"]}, 400,
             "bad worker flags"),
            ({**launch_body(tiny_model_dir, "m"), "worker_args": ["--port", "1"]}, 400,
             "set by the launch"),
            ({**launch_body(tiny_model_dir, "m"), "replicas": 0}, 400, "replicas"),
            ({**launch_body(tiny_model_dir, "m"), "kv_cache_memory": "lots"}, 400, "memory size"),
            ({**launch_body(tiny_model_dir, "m"), "colour": "red"}, 400, "colour"),
            ({**launch_body(tiny_model_dir, "m"), "host": "elsewhere"}, 400, "no host agent"),
            ({**launch_body(tiny_model_dir, "m"), "kv_cache_memory": "2GiB"}, 409, "would fit"),
        ]
        for body, status, says in refused:
            response = rt.admin("POST", "/models", json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert says in error["message"], error
        fits = rt.admin("POST", "/models", json={**launch_body(tiny_model_dir, "m"),
                                                 "kv_cache_memory": "2GiB"}).json()
        assert "kv_cache_memory of at most" in fits["error"]["message"]
        assert rt.admin("POST", "/models", key=USER, json=launch_body(tiny_model_dir, "m")
                        ).status_code == 403
        assert rt.admin("POST", "/models", key=None, json=launch_body(tiny_model_dir, "m")
                        ).status_code == 401
        assert rt.admin("DELETE", "/models/nothing").status_code == 404
        assert rt.states() == {} and rt.worker_pids() == []

        bad_on_demand = {**launch_body(tiny_model_dir, "m", on_demand=True),
                         "worker_args": ["--dtype", "float13"]}
        refused = rt.admin("POST", "/models", json=bad_on_demand)
        assert refused.status_code == 400 and "bad worker flags" in refused.text
        on_demand = launch_body(tiny_model_dir, "m", on_demand=True)
        assert rt.admin("POST", "/models", json=on_demand).status_code == 202
        assert rt.admin("POST", "/models", json=on_demand).status_code == 409  # exists
        assert rt.admin("DELETE", "/models/m").status_code == 202
        assert rt.states() == {} and rt.worker_pids() == []


def test_on_demand_model_starts_on_request_and_unloads_when_idle(tmp_path, tiny_model_dir):
    with runtime(tmp_path) as rt:
        body = launch_body(tiny_model_dir, "lazy", on_demand=True, keep_alive=5)
        response = rt.admin("POST", "/models", json=body)
        assert response.status_code == 202 and response.json()["state"] == "not_loaded"
        client = rt.client()
        cards = {m.id: m for m in client.models.list()}
        assert cards["lazy"].model_extra["loaded"] is False
        assert client.models.retrieve("lazy").model_extra["loaded"] is False
        assert rt.worker_pids() == []

        # The first request starts it, and is answered (streamed: the openai client skips the
        # keep-alive comments).
        stream = client.chat.completions.create(
            model="lazy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
        assert rt.states()["lazy"]["state"] == "ready"
        assert len(rt.worker_pids()) == 1

        # Idle past its keep_alive: unloaded, still launchable.
        rt.wait_state("lazy", "not_loaded")
        assert rt.worker_pids() == []

        # Started again by a raw stream, which sees the keep-alive comments while it waits.
        with httpx.stream("POST", f"{rt.gateway_url}/v1/chat/completions", timeout=LOAD_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {USER}"},
                          json={"model": "lazy", "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 3, "stream": True}) as raw:
            assert raw.status_code == 200
            lines = [line for line in raw.iter_lines() if line]
        assert ": keep-alive" in lines, lines[:5]
        assert lines[-1] == "data: [DONE]" and any('"finish_reason":"length"' in line
                                                   for line in lines)
        assert rt.admin("DELETE", "/models/lazy").status_code == 202
        rt.wait_state("lazy", None)


def test_a_request_routed_to_the_stopped_worker_of_an_unloaded_model_starts_it_again(
        tmp_path, tiny_model_dir):
    # The gateway's routing table is read from the controller every --worker-refresh-interval:
    # for up to that long after an on-demand model is unloaded, it still names the stopped
    # worker. A request in that window must start the model again, not fail with the refused
    # connection. Refreshes are made rare here and the stale table put back by hand, so the
    # window is certain rather than a race.
    with runtime(tmp_path, worker_refresh_interval=600) as rt:
        body = launch_body(tiny_model_dir, "lazy", on_demand=True, keep_alive=2)
        assert rt.admin("POST", "/models", json=body).status_code == 202
        client = rt.client()
        assert chat(client, "lazy") is not None
        listing = ListWorkersResponse.model_validate(
            httpx.get(f"{rt.controller_url}/list_workers", timeout=30).json())
        assert [w.model_names for w in listing.workers] == [["lazy"]]

        def stale_table() -> None:
            update_from_listing(rt.gateway_app.state.routing_table, listing,
                                requested_at=time.monotonic())

        for stream in (False, True):
            rt.wait_state("lazy", "not_loaded")
            stale_table()
            reply = client.chat.completions.create(
                model="lazy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                stream=stream)
            chunks = list(reply) if stream else [reply]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert rt.states()["lazy"]["state"] == "ready"
        assert rt.admin("DELETE", "/models/lazy").status_code == 202
        rt.wait_state("lazy", None)


def test_a_worker_that_dies_while_loading_fails_its_model_with_the_reason(tmp_path, tiny_model_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_model_dir.iterdir():  # the tiny model's config and tokenizer...
        if not item.name.endswith(".safetensors") and item.is_file():
            (broken / item.name).write_bytes(item.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # ...and no weights
    with runtime(tmp_path) as rt:
        response = rt.admin("POST", "/models", json=launch_body(broken, "broken", replicas=2))
        assert response.status_code == 202, response.text
        failed = rt.wait_state("broken", "failed")
        assert "worker exited" in failed["reason"] and "its log ends" in failed["reason"]
        wait_until(lambda: rt.worker_pids() == [], what="the other replica stopped")
        # Still listed with its reason until it is stopped; then gone.
        assert rt.admin("DELETE", "/models/broken").status_code == 202
        rt.wait_state("broken", None)


def test_a_restarted_controller_takes_over_the_launched_models(tmp_path, tiny_model_dir):
    with runtime(tmp_path) as rt:
        assert rt.admin("POST", "/models", json=launch_body(tiny_model_dir, "tiny2")).status_code == 202
        rt.wait_state("tiny2", "ready")
        [pid] = rt.worker_pids()
        rt.restart_controller()
        # The worker registers again (its next heartbeat is told it is unknown); the agent
        # reports it with its launch, and the new controller manages it as before.
        model = wait_until(lambda: (lambda m: m if m and m["managed"] else None)(
            rt.states().get("tiny2")), what="tiny2 managed again")
        assert model["state"] in ("loading", "ready") and model["model_path"] == str(tiny_model_dir)
        rt.wait_state("tiny2", "ready")
        assert chat(rt.client(), "tiny2") is not None
        assert rt.admin("DELETE", "/models/tiny2").status_code == 202
        rt.wait_state("tiny2", None)
        assert rt.worker_pids() == [] and not alive(pid)
