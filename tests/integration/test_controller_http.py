"""The controller over real HTTP: real uvicorn servers on 127.0.0.1 ephemeral ports, httpx clients."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from llmplatform.controller import ControllerConfig, create_app
from llmplatform.routing.policies import DispatchMethod
from llmplatform.utils.server import serve_in_thread
from tests.fake_worker import FULL_REPLY, FakeWorkerState, make_fake_worker
from tests.polling import wait_until
from tests.stub_workers import StubWorkers, stub_workers

FAKE_MODEL = "fake-model"
TIMEOUT = httpx.Timeout(5.0)


def closed_port_url() -> str:
    """A URL nobody listens on (the port was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fake_worker_and_state() -> Iterator[tuple[str, FakeWorkerState]]:
    """A fake worker (tests/fake_worker.py) serving FAKE_MODEL, and what it has received."""
    app, state = make_fake_worker([FAKE_MODEL])
    with serve_in_thread(app) as url:
        yield url, state


@pytest.fixture
def fake_worker(fake_worker_and_state: tuple[str, FakeWorkerState]) -> str:
    return fake_worker_and_state[0]


@pytest.fixture(scope="module")
def stubs() -> Iterator[StubWorkers]:
    """Status routes for workers that are only registered, never sent a request."""
    with stub_workers() as stubs:
        yield stubs


class Controller:
    """A running controller: its URL, its app (to look at the registry), an httpx client."""

    def __init__(self, url: str, app: FastAPI, client: httpx.Client) -> None:
        self.url, self.app, self.client = url, app, client

    def post(self, route: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        if body is not None:
            kwargs["json"] = body
        return self.client.post(self.url + route, **kwargs)

    def register(self, worker_name: str, models: list[str] | None = None, **extra: Any) -> httpx.Response:
        status = None if models is None else {"model_names": models, "speed": 1, "queue_length": 0}
        body = {"worker_name": worker_name, "check_heart_beat": True, "worker_status": status, **extra}
        return self.post("/register_worker", body)

    def heartbeat(self, worker_name: str, queue_length: int = 0) -> bool:
        body = {"worker_name": worker_name, "queue_length": queue_length}
        response = self.post("/receive_heart_beat", body)
        assert response.status_code == 200, response.text
        return response.json()["exist"]

    def models(self, route: str = "/list_models") -> list[str]:
        response = self.post(route)
        assert response.status_code == 200, response.text
        return response.json()["models"]

    def address(self, model: str) -> str:
        response = self.post("/get_worker_address", {"model": model})
        assert response.status_code == 200, response.text
        return response.json()["address"]


StartController = Callable[..., "tuple[Controller, Callable[[], None]]"]


@pytest.fixture
def start_controller() -> Iterator[StartController]:
    """Start a controller (a fresh app each call) -> (controller, stop). All stop at test end."""
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=TIMEOUT))

        def start(**config: Any) -> tuple[Controller, Callable[[], None]]:
            app = create_app(ControllerConfig(**config))
            server_stack = stack.enter_context(contextlib.ExitStack())
            url = server_stack.enter_context(serve_in_thread(app))
            return Controller(url, app, client), server_stack.close

        yield start


@pytest.fixture
def controller(start_controller: StartController) -> Controller:
    return start_controller()[0]


@pytest.fixture(scope="module")
def shared_controller() -> Iterator[Controller]:
    """One controller for the many parametrized cases that must leave it unchanged."""
    app = create_app()
    with httpx.Client(timeout=TIMEOUT) as client, serve_in_thread(app) as url:
        yield Controller(url, app, client)


def parse_stream(data: bytes) -> list[dict[str, Any]]:
    assert data.endswith(b"\0")
    return [json.loads(part) for part in data.split(b"\0")[:-1]]


# ---- basics -------------------------------------------------------------------------------------


def test_test_connection_and_health(controller: Controller) -> None:
    response = controller.client.get(controller.url + "/test_connection")
    assert response.status_code == 200 and response.json() == "success"
    response = controller.client.get(controller.url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_no_arg_routes_accept_empty_or_missing_bodies(controller: Controller) -> None:
    routes = [
        "/list_models",
        "/list_language_models",
        "/list_multimodal_models",
        "/worker_get_status",
        "/refresh_all_workers",
    ]
    for route in routes:
        json_header = {"content-type": "application/json"}
        for kwargs in ({}, {"content": b""}, {"content": b"", "headers": json_header}):
            response = controller.post(route, **kwargs)
            assert response.status_code == 200, (route, kwargs, response.text)
    empty = {"model_names": [], "speed": 0, "queue_length": 0}
    assert controller.post("/worker_get_status").json() == empty


# ---- registration -------------------------------------------------------------------------------


def test_register_with_status_then_list_and_address(controller: Controller, stubs: StubWorkers) -> None:
    worker = stubs.url("list-1", ["llama", "alias"])
    response = controller.register(worker, ["llama", "alias"])
    assert response.status_code == 200 and response.json() is None  # FastChat answers null
    vision = stubs.url("list-2", ["llava"])
    assert controller.register(vision, ["llava"], multimodal=True).status_code == 200
    assert controller.models() == ["alias", "llama", "llava"]
    assert controller.models("/list_language_models") == ["alias", "llama"]
    assert controller.models("/list_multimodal_models") == ["llava"]
    assert controller.address("llama") == worker
    assert controller.address("llava") == vision
    assert controller.address("unknown") == ""


def test_register_without_status_polls_the_worker(controller: Controller, stubs: StubWorkers) -> None:
    worker = stubs.url("polled", [FAKE_MODEL], queue_length=2, extra="ignored")
    response = controller.register(worker + "/")  # trailing slash: same worker
    assert response.status_code == 200, response.text
    assert controller.models() == [FAKE_MODEL]
    assert controller.address(FAKE_MODEL) == worker
    status = controller.post("/worker_get_status").json()
    assert status == {"model_names": [FAKE_MODEL], "speed": 1, "queue_length": 3}  # 2 + the pick


@pytest.mark.parametrize("models", [None, ["ghost"]], ids=["without-status", "with-status"])
def test_register_unreachable_worker_is_never_routed(start_controller: StartController, models: Any) -> None:
    controller, _ = start_controller(confirm_timeout=0.5)
    dead = closed_port_url()
    response = controller.register(dead, models)
    if models is None:  # nothing to wait for: refused
        assert response.status_code == 400
        assert dead in response.json()["error"]
    else:  # a stock FastChat worker registers before it listens: held, not routed
        assert response.status_code == 200 and response.json()["pending"] is True
        assert controller.app.state.confirmations.is_pending(dead)
        wait_until(lambda: not controller.app.state.confirmations.is_pending(dead),
                   what="the unconfirmed registration dropped")
    assert controller.models() == [] and controller.address("ghost") == ""
    assert controller.heartbeat(dead) is False


@pytest.mark.parametrize(
    "worker_name",
    [
        "http://0.0.0.0:21002",
        "http://[::]:21002",
        "127.0.0.1:21002",
        "ftp://127.0.0.1:21",
        "http://",
        "http://h:99999",
    ],
)
def test_unusable_worker_urls_are_refused(shared_controller: Controller, worker_name: str) -> None:
    response = shared_controller.register(worker_name, ["m"])
    assert response.status_code == 400
    assert "error" in response.json()
    assert shared_controller.models() == []


def test_bind_all_address_message_is_clear(controller: Controller) -> None:
    error = controller.register("http://0.0.0.0:21002", ["m"]).json()["error"]
    assert "0.0.0.0" in error and "bind" in error


def test_reregistration_with_other_models_is_refused(
    controller: Controller, stubs: StubWorkers, caplog: pytest.LogCaptureFixture
) -> None:
    # A stock worker (no instance id) announcing a live worker's URL with other models is a
    # second worker on one address: refused (409) and logged, never a silent replacement.
    worker = stubs.url("rereg", ["a"])
    with caplog.at_level(logging.INFO, logger="llmplatform.controller"):
        assert controller.register(worker, ["a"]).status_code == 200
        controller.register(worker, ["a"])  # a restart: normal, no warning
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        stubs.url("rereg", ["b"])  # now something else answers there
        assert controller.register(worker, ["b"]).status_code == 409
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and worker in warnings[0].getMessage()
    assert controller.models() == ["a"]


# ---- heartbeats and expiry ------------------------------------------------------------------------


def test_heartbeat_exists_then_not_after_controller_restart(
    start_controller: StartController, stubs: StubWorkers
) -> None:
    worker = stubs.url("restart")
    first, stop_first = start_controller()
    first.register(worker, ["m"])
    assert first.heartbeat(worker, queue_length=4) is True
    assert first.post("/worker_get_status").json()["queue_length"] == 4
    stop_first()
    second, _ = start_controller()  # a restarted controller has an empty registry
    assert second.heartbeat(worker) is False
    second.register(worker, ["m"])  # what the worker does on exist=false
    assert second.heartbeat(worker) is True


def test_heartbeat_with_load_facts(controller: Controller, stubs: StubWorkers) -> None:
    worker = stubs.url("facts")
    controller.register(worker, ["m"])
    body = {
        "worker_name": worker,
        "queue_length": 3,
        "num_running": 2,
        "num_waiting": 1,
        "kv_cache_usage": 0.4,
    }
    assert controller.post("/receive_heart_beat", body).json() == {"exist": True}
    info = controller.app.state.registry.get(worker)
    assert (info.queue_length, info.num_running, info.num_waiting, info.kv_cache_usage) == (3, 2, 1, 0.4)


def test_silent_worker_expires(start_controller: StartController, stubs: StubWorkers) -> None:
    controller, _ = start_controller(heartbeat_expiration=0.5)
    worker, beating = stubs.url("silent", ["silent"]), stubs.url("beating", ["alive"])
    assert controller.register(worker, ["silent"]).status_code == 200
    assert controller.register(beating, ["alive"]).status_code == 200
    stubs.statuses.pop("silent")  # gone: its status polls fail from now on
    registry = controller.app.state.registry
    start = time.monotonic()

    def silent_one_expired() -> bool:  # the other keeps beating and must stay
        assert controller.heartbeat(beating) is True
        return worker not in registry

    wait_until(silent_one_expired, interval_s=0.1, what="the background sweep to remove the silent worker")
    assert time.monotonic() - start >= 0.5
    assert controller.models() == ["alive"]
    assert controller.heartbeat(worker) is False
    assert controller.address("silent") == ""


def test_refresh_all_workers_drops_unreachable(
    controller: Controller, fake_worker: str, stubs: StubWorkers
) -> None:
    controller.register(fake_worker)
    dead = stubs.url("refresh-dead", ["ghost"])
    assert controller.register(dead, ["ghost"]).status_code == 200
    assert controller.models() == [FAKE_MODEL, "ghost"]
    stubs.statuses.pop("refresh-dead")  # its status route answers 404 from now on
    response = controller.post("/refresh_all_workers")
    assert response.status_code == 200 and response.json() == {"removed": [dead]}
    assert controller.models() == [FAKE_MODEL]


# ---- streaming proxy ------------------------------------------------------------------------------


def test_generate_stream_is_proxied_to_the_worker(
    controller: Controller, fake_worker_and_state: tuple[str, FakeWorkerState]
) -> None:
    fake_worker, fake_worker_state = fake_worker_and_state
    controller.register(fake_worker)
    params = {"model": FAKE_MODEL, "prompt": "hi", "request_id": "r-1", "unknown_field": [1, 2]}
    url = controller.url + "/worker_generate_stream"
    with controller.client.stream("POST", url, json=params) as response:
        assert response.status_code == 200
        data = b"".join(response.iter_bytes())
    chunks = parse_stream(data)
    assert chunks[-1]["text"] == "hi" + FULL_REPLY  # the prompt echoed: FastChat's default
    assert chunks[-1]["finish_reason"] == "stop"
    assert fake_worker_state.params[-1] == params  # forwarded untouched


def test_client_disconnect_closes_the_worker_stream(
    controller: Controller, fake_worker_and_state: tuple[str, FakeWorkerState]
) -> None:
    fake_worker, worker_state = fake_worker_and_state
    controller.register(fake_worker)
    # SLOW: a tick every 50 ms, 10000 of them: the stream outlasts the test unless closed.
    params = {"model": FAKE_MODEL, "prompt": "SLOW", "request_id": "endless-1", "max_new_tokens": 10000}
    url = controller.url + "/worker_generate_stream"
    with controller.client.stream("POST", url, json=params) as response:
        first = next(response.iter_bytes())
        assert first.startswith(b'{"text"')
    # Leaving the block closes our connection; the controller must close its upstream one.
    wait_until(lambda: "endless-1" in worker_state.closed_early, what="the worker's stream closed early")


def test_generate_stream_without_worker(controller: Controller) -> None:
    response = controller.post("/worker_generate_stream", {"model": "nobody", "prompt": "hi"})
    assert response.status_code == 200
    (chunk,) = parse_stream(response.content)
    assert chunk["error_code"] == 50005 and "nobody" in chunk["text"]


def test_generate_stream_worker_down(controller: Controller) -> None:
    # A worker that answered its status poll, then went away.
    with serve_in_thread(make_fake_worker([FAKE_MODEL])[0]) as doomed:
        assert controller.register(doomed).status_code == 200
    dead = doomed
    assert controller.address(FAKE_MODEL) == dead
    response = controller.post("/worker_generate_stream", {"model": FAKE_MODEL, "prompt": "hi"})
    assert response.status_code == 200
    (chunk,) = parse_stream(response.content)
    assert chunk["error_code"] == 50006 and dead not in chunk["text"]


# ---- client mistakes are 400, never 500 -----------------------------------------------------------


@pytest.mark.parametrize(
    "route", ["/register_worker", "/receive_heart_beat", "/get_worker_address", "/worker_generate_stream"]
)
@pytest.mark.parametrize(
    "content", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"unrelated": 1}']
)
def test_bad_bodies_are_400(shared_controller: Controller, route: str, content: bytes) -> None:
    response = shared_controller.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert isinstance(response.json()["error"], str)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/register_worker", {"worker_name": "http://127.0.0.1:1", "worker_status": {"model_names": "m"}}),
        (
            "/register_worker",
            {"worker_name": "http://127.0.0.1:1", "worker_status": {"model_names": ["m"], "speed": -1}},
        ),
        ("/register_worker", {"worker_name": 5}),
        ("/receive_heart_beat", {"worker_name": "http://127.0.0.1:1", "queue_length": "many"}),
        ("/receive_heart_beat", {"worker_name": "http://127.0.0.1:1"}),
        ("/get_worker_address", {"model": ["a"]}),
        ("/worker_generate_stream", {"model": None, "prompt": "x"}),
    ],
)
def test_wrong_types_are_400(shared_controller: Controller, route: str, body: Any) -> None:
    response = shared_controller.post(route, body)
    assert response.status_code == 400, response.text
    assert "error" in response.json()


def test_shortest_queue_spreads_a_burst_over_http(start_controller: StartController, stubs: StubWorkers) -> None:
    controller, _ = start_controller(dispatch_method=DispatchMethod.SHORTEST_QUEUE)
    workers = [stubs.url("burst-1"), stubs.url("burst-2")]
    for worker in workers:
        controller.register(worker, ["m"])
    picks = [controller.address("m") for _ in range(6)]
    assert sorted(picks) == sorted(workers * 3)


# ---- workers a supervisor left down --------------------------------------------------------------


def test_a_worker_reported_down_is_not_routed_to_and_listed_until_back(
        controller: Controller, stubs: StubWorkers) -> None:
    worker = stubs.url("down-1", ["crashy"])
    assert controller.register(worker, ["crashy"]).status_code == 200
    assert controller.address("crashy") == worker
    report = {"worker_name": worker + "/", "service": "worker 3", "down": True,
              "reason": "exited unexpectedly (exit code 1) 6 times within 60 s", "retry_in_s": 60}
    assert controller.post("/report_worker_state", report).json() == {"changed": True}
    assert controller.address("crashy") == ""  # dropped at once, not after heartbeat expiry
    listing = controller.client.get(controller.url + "/list_workers").json()
    assert listing["workers"] == []
    [down] = listing["down_workers"]
    assert down["worker_name"] == worker and down["service"] == "worker 3"
    assert down["model_names"] == ["crashy"] and down["reason"] == report["reason"]
    assert 0 <= down["retry_in_s"] <= 60
    # Registered again (the retry), it leaves the list; a report "back" finds nothing left.
    assert controller.register(worker, ["crashy"]).status_code == 200
    assert controller.client.get(controller.url + "/list_workers").json()["down_workers"] == []
    back = dict(report, down=False, reason=None, retry_in_s=None)
    assert controller.post("/report_worker_state", back).json() == {"changed": False}


@pytest.mark.parametrize("body", [
    {"worker_name": "http://w:1"},                                    # no "down"
    {"worker_name": "", "down": True},                                # empty name
    {"worker_name": "http://w:1", "down": True, "reason": "x" * 501},  # over the cap
    {"worker_name": "http://w:1", "down": True, "retry_in_s": -1},
    [1, 2],
])
def test_a_malformed_state_report_is_a_400(shared_controller: Controller, body: Any) -> None:
    response = shared_controller.post("/report_worker_state", body)
    assert response.status_code == 400, response.text
    assert "WorkerStateReport" in response.json()["error"]
