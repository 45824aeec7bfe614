"""The cluster secret: with one set, registration, heartbeats and every call between controller,
workers and gateway carry it (X-LLMPlatform-Secret), and a request without it is refused (401)
before any outbound call.

Real controller, real workers (the tiny model), real gateway, all on 127.0.0.1. "No outbound
call" is witnessed twice: a recording transport inside the controller and a listening socket
that counts the connections it is offered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api import GatewaySettings
from llmplatform.openai_api import create_app as create_gateway_app
from llmplatform.utils.cluster_secret import SECRET_ENV, SECRET_HEADER
from llmplatform.utils.server import serve_in_thread
from tests.polling import wait_until
from tests.security.helpers import ConnectionCounter, RecordingTransport
from tests.stub_workers import stub_workers

SECRET = "cluster-secret-for-tests"
GOOD = {SECRET_HEADER: SECRET}
MODEL = "tiny"
STATUS = {"model_names": ["m"], "speed": 1, "queue_length": 0}


@pytest.fixture
def controller() -> Iterator[tuple[str, RecordingTransport]]:
    transport = RecordingTransport()
    app = create_controller_app(ControllerConfig(cluster_secret=SECRET), transport=transport)
    with serve_in_thread(app) as url:
        yield url, transport


# ---- the controller -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {SECRET_HEADER: ""}, {SECRET_HEADER: "wrong"}, {SECRET_HEADER: SECRET.upper()},
     {SECRET_HEADER: SECRET[:-1]}, {"Authorization": f"Bearer {SECRET}"},
     {"X-LLMPlatform-Secrets": SECRET}],
    ids=["none", "empty", "wrong", "upper", "prefix", "as-bearer", "other-header"],
)
def test_registration_without_the_secret_is_refused_before_any_dial(
    controller: tuple[str, RecordingTransport], headers: dict[str, str]
) -> None:
    url, transport = controller
    with ConnectionCounter() as worker:
        # worker_status null: an accepted registration would make the controller dial the worker.
        response = httpx.post(f"{url}/register_worker", headers=headers,
                              json={"worker_name": worker.url, "check_heart_beat": True, "worker_status": None})
        assert response.status_code == 401, response.text
        assert SECRET_HEADER in response.json()["error"]
        assert worker.settled_count() == 0
    assert transport.requests == []
    assert httpx.post(f"{url}/list_models", headers=GOOD).json()["models"] == []


def test_registration_with_the_secret_dials_and_sends_the_secret(controller: tuple[str, RecordingTransport]) -> None:
    url, transport = controller
    worker_app = _status_only_worker(["m"])
    with serve_in_thread(worker_app) as worker_url:
        response = httpx.post(f"{url}/register_worker", headers=GOOD,
                              json={"worker_name": worker_url, "check_heart_beat": True, "worker_status": None})
        assert response.status_code == 200, response.text
    assert transport.urls() == [f"{worker_url}/worker_get_status"]
    assert transport.requests[0].headers[SECRET_HEADER] == SECRET  # the controller carries it too
    assert worker_app.state.seen_secrets == [SECRET]
    assert httpx.post(f"{url}/list_models", headers=GOOD).json()["models"] == ["m"]


def _status_only_worker(models: list[str]) -> FastAPI:
    app = FastAPI()
    app.state.seen_secrets = []

    @app.post("/worker_get_status")
    async def status(request: Request) -> dict[str, Any]:
        app.state.seen_secrets.append(request.headers.get(SECRET_HEADER))
        return {"model_names": models, "speed": 1, "queue_length": 0}

    return app


def test_heartbeats_need_the_secret(controller: tuple[str, RecordingTransport]) -> None:
    url, _ = controller
    with stub_workers() as stubs:  # a worker the controller can confirm (its status answers)
        name = stubs.url("beats")
        assert httpx.post(f"{url}/register_worker", headers=GOOD,
                          json={"worker_name": name, "worker_status": STATUS}).status_code == 200
    beat = {"worker_name": name, "queue_length": 0}
    assert httpx.post(f"{url}/receive_heart_beat", json=beat).status_code == 401
    assert httpx.post(f"{url}/receive_heart_beat", json=beat, headers={SECRET_HEADER: "x"}).status_code == 401
    assert httpx.post(f"{url}/receive_heart_beat", json=beat, headers=GOOD).json() == {"exist": True}


def test_every_controller_route_but_the_public_ones_needs_the_secret(controller: tuple[str, RecordingTransport]) -> None:
    url, transport = controller
    app = create_controller_app(ControllerConfig())
    routes = [(r.path, sorted(r.methods)[0]) for r in app.routes if hasattr(r, "methods")]
    public = {"/health", "/metrics", "/test_connection"}
    checked = 0
    for path, method in routes:
        if path in public or path.startswith(("/docs", "/redoc", "/openapi")):
            continue
        response = httpx.request(method, f"{url}{path}", json={"model": "m", "worker_name": "http://127.0.0.1:1"})
        assert response.status_code == 401, (path, response.status_code)
        checked += 1
    assert checked >= 8  # register, heartbeat, list_models (x3), get_worker_address, status, stream...
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/test_connection").json() == "success"
    assert transport.requests == []


# ---- workers and the whole cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_cluster(tiny_model_dir: Any) -> Iterator[dict[str, Any]]:
    """Controller, a real tiny-model worker and a gateway, all sharing SECRET."""
    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=(MODEL,), backend="paged",
                                  device="cpu", dtype="float32", kv_cache_memory="32MiB"))
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(create_controller_app(
            ControllerConfig(cluster_secret=SECRET))))
        gateway = stack.enter_context(serve_in_thread(create_gateway_app(
            GatewaySettings(controller_address=controller, cluster_secret=SECRET))))
        worker_app = create_worker_app(llm, WorkerSettings(
            controller_address=controller, cluster_secret=SECRET, heartbeat_interval=0.5,
            limit_worker_concurrency=8))
        worker = stack.enter_context(serve_in_thread(worker_app))
        worker_app.state.worker_address = worker
        wait_until(lambda: httpx.post(f"{controller}/list_models", headers=GOOD).json()["models"] == [MODEL],
                   what="the worker registered with the secret")
        yield {"controller": controller, "gateway": gateway, "worker": worker, "worker_app": worker_app}


def test_a_cluster_with_a_secret_serves(secret_cluster: dict[str, Any]) -> None:
    # Registration and heartbeats (worker -> controller), gateway -> controller and
    # gateway -> worker all carry the secret, or this would fail.
    client = openai.OpenAI(base_url=f"{secret_cluster['gateway']}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    streamed = list(client.completions.create(model=MODEL, prompt="The sea", max_tokens=3, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"
    # The controller's own proxy route reaches the worker with the secret as well.
    with httpx.stream("POST", f"{secret_cluster['controller']}/worker_generate_stream", headers=GOOD,
                      json={"model": MODEL, "prompt": "hi", "max_new_tokens": 2, "echo": False}) as response:
        frames = [f for f in response.read().split(b"\0") if f]
    import json

    assert json.loads(frames[-1])["finish_reason"] == "length", frames[-1]


def test_every_worker_route_but_the_public_ones_needs_the_secret(secret_cluster: dict[str, Any]) -> None:
    worker, app = secret_cluster["worker"], secret_cluster["worker_app"]
    llm = app.state.llm
    before = llm.load()
    checked = 0
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if not methods or route.path in ("/health", "/metrics") or route.path.startswith(("/docs", "/redoc", "/openapi")):
            continue
        body = {"model": MODEL, "prompt": "hi", "max_new_tokens": 2, "request_id": "r", "messages": []}
        for headers in ({}, {SECRET_HEADER: "wrong"}):
            response = httpx.request(sorted(methods)[0], f"{worker}{route.path}", json=body, headers=headers)
            assert response.status_code == 401, (route.path, response.status_code, response.text[:200])
        checked += 1
    assert checked >= 8
    assert llm.load().num_running == before.num_running == 0
    assert httpx.get(f"{worker}/health").status_code == 200
    assert httpx.post(f"{worker}/worker_get_status", headers=GOOD).status_code == 200


def test_a_gateway_without_the_secret_gets_nothing(secret_cluster: dict[str, Any]) -> None:
    for secret in (None, "wrong-secret"):
        settings = GatewaySettings(controller_address=secret_cluster["controller"], cluster_secret=secret)
        with serve_in_thread(create_gateway_app(settings)) as gateway:
            client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert info.value.status_code == 502  # the controller refused the gateway


async def test_a_worker_without_the_secret_never_registers(secret_cluster: dict[str, Any]) -> None:
    from llmplatform.model_worker.registration import ControllerLink

    controller = secret_cluster["controller"]
    with ConnectionCounter() as rogue:
        async with httpx.AsyncClient(headers={SECRET_HEADER: "guess"}) as client:
            link = ControllerLink(client, controller, lambda: rogue.url,
                                  lambda: {"model_names": [MODEL, "rogue"], "speed": 1, "queue_length": 0},
                                  heartbeat_interval=0.2, max_backoff=0.2)
            link.start()
            try:
                import asyncio

                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(link.registered.wait(), timeout=1.5)
            finally:
                await link.leave()
        assert rogue.settled_count() == 0  # nobody dialled the rogue's address
    models = httpx.post(f"{controller}/list_models", headers=GOOD).json()["models"]
    assert models == [MODEL]


def test_serve_passes_the_secret_in_the_environment_not_on_command_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.serve import launcher

    seen: dict[str, Any] = {}

    class RecordingSupervisor:
        def __init__(self, services: list[Any], *args: Any, **kwargs: Any) -> None:
            self.services = services

        def start(self) -> None:
            seen["env"] = {service.name: service.env.get(SECRET_ENV) for service in self.services}
            seen["argv"] = [arg for service in self.services for arg in service.argv]
            raise KeyboardInterrupt

        def stop(self) -> None:
            pass

    monkeypatch.setattr(launcher, "Supervisor", RecordingSupervisor)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    import signal

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit):
            launcher.main(["--cluster-secret", "s3cret-value"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    # Every service gets the secret in its own environment, none on a command line.
    assert seen["env"] and set(seen["env"].values()) == {"s3cret-value"}
    assert not any("s3cret-value" in arg for arg in seen["argv"])


@pytest.mark.parametrize("module", ["llmplatform.controller", "llmplatform.model_worker",
                                    "llmplatform.openai_api", "llmplatform.webui"])
def test_the_secret_flag_and_environment(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    from llmplatform.serve.launcher import service_settings_models

    settings = service_settings_models()[module]
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert settings.parse(["--cluster-secret", "from-flag"]).cluster_secret == "from-flag"
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert settings.parse([]).cluster_secret == "from-env"
    assert settings.parse(["--cluster-secret", "from-flag"]).cluster_secret == "from-flag"
    monkeypatch.setenv(SECRET_ENV, "  ")
    assert settings.parse([]).cluster_secret is None
