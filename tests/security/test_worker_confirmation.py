"""A registered worker is routed only once the controller has reached it, and a status poll never
brings back a worker that left.

Real controller and stub workers (tests/stub_workers.py), each a uvicorn server on 127.0.0.1.
Races are made deterministic with a held status call: the stub's `/worker_get_status` waits,
with the controller's poll known to be in flight, until the test has done the racing step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.controller.workers import _poll_quiet_workers
from llmplatform.utils.server import serve_in_thread
from tests.polling import wait_until
from tests.processes import free_port
from tests.stub_workers import StubWorkers, stub_workers

TIMEOUT_S = 10.0


class Controller:
    def __init__(self, url: str, app: FastAPI) -> None:
        self.url, self.app = url, app

    def post(self, route: str, body: Any = None) -> httpx.Response:
        return httpx.post(self.url + route, json=body, timeout=TIMEOUT_S)

    def register(self, name: str, models: list[str] | None = None, **extra: Any) -> httpx.Response:
        status = None if models is None else {"model_names": models, "speed": 1, "queue_length": 0}
        return self.post("/register_worker", {"worker_name": name, "check_heart_beat": True,
                                              "worker_status": status, **extra})

    def deregister(self, name: str, **ids: str) -> bool:
        return self.post("/deregister_worker", {"worker_name": name, **ids}).json()["removed"]

    def routed(self, model: str = "m") -> dict[str, Any]:
        """Every way a worker can be routed to or seen, for `model`."""
        stream = self.post("/worker_generate_stream", {"model": model, "prompt": "hi"})
        return {
            "models": self.post("/list_models").json()["models"],
            "address": self.post("/get_worker_address", {"model": model}).json()["address"],
            "workers": [w["worker_name"] for w in httpx.get(self.url + "/list_workers").json()["workers"]],
            # The controller's own proxy: 50005 is "no worker serves the model".
            "stream_error_code": json.loads(stream.content.split(b"\0")[0]).get("error_code"),
        }

    def nothing_routed(self, model: str = "m") -> bool:
        return self.routed(model) == {"models": [], "address": "", "workers": [], "stream_error_code": 50005}


@pytest.fixture
def start_controller() -> Iterator[Callable[..., Controller]]:
    with contextlib.ExitStack() as stack:
        def start(**config: Any) -> Controller:
            app = create_controller_app(ControllerConfig(**config))
            return Controller(stack.enter_context(serve_in_thread(app)), app)

        yield start


@pytest.fixture
def controller(start_controller: Callable[..., Controller]) -> Controller:
    return start_controller()


@pytest.fixture(scope="module")
def stubs() -> Iterator[StubWorkers]:
    with stub_workers() as stubs:
        yield stubs


def in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


# ---- an address that does not answer ---------------------------------------------------------------


def test_a_registration_of_an_address_that_does_not_answer_is_refused(controller: Controller) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    response = controller.register(dead)
    assert response.status_code == 400, response.text
    assert "cannot get status" in response.json()["error"]
    assert controller.nothing_routed()
    assert controller.post("/receive_heart_beat", {"worker_name": dead, "queue_length": 0}).json() == {"exist": False}


def test_a_registration_with_a_status_at_a_silent_address_is_never_routed(
    start_controller: Callable[..., Controller],
) -> None:
    controller = start_controller(confirm_timeout=0.5)
    dead = f"http://127.0.0.1:{free_port()}"
    response = controller.register(dead, ["m"])
    # A stock FastChat worker registers before it listens, and exits on anything but 200.
    assert response.status_code == 200 and response.json()["pending"] is True
    assert controller.nothing_routed()
    confirmations = controller.app.state.confirmations
    wait_until(lambda: not confirmations.is_pending(dead), timeout_s=TIMEOUT_S, what="the pending one dropped")
    assert controller.nothing_routed()


def test_a_worker_that_starts_listening_after_registering_is_confirmed(controller: Controller) -> None:
    """FastChat's order: register from the constructor, then uvicorn.run."""
    port = free_port()
    stubs = StubWorkers("")
    name = f"http://127.0.0.1:{port}/w/late"
    assert controller.register(name, ["m"]).json()["pending"] is True
    assert controller.nothing_routed()
    stubs.url("late")
    with serve_in_thread(stubs.app(), port=port):
        wait_until(lambda: controller.routed()["address"] == name, timeout_s=TIMEOUT_S, what="confirmed")
        assert controller.routed()["models"] == ["m"]


# ---- what the address answers ------------------------------------------------------------------------


def test_a_worker_claiming_a_model_its_status_does_not_list_is_refused(
    controller: Controller, stubs: StubWorkers
) -> None:
    name = stubs.url("claims", ["m"])
    response = controller.register(name, ["m", "someone-elses-model"])
    assert response.status_code == 400
    assert "someone-elses-model" in response.json()["error"]
    assert controller.nothing_routed() and controller.nothing_routed("someone-elses-model")


def test_another_service_at_the_address_is_refused(controller: Controller, stubs: StubWorkers) -> None:
    name = f"{stubs.base_url}/not-a-worker"  # answers 404 to /worker_get_status
    for models in (None, ["m"]):
        response = controller.register(name, models)
        assert response.status_code == 400 and "HTTP 404" in response.json()["error"]
    assert controller.nothing_routed()


def test_a_registration_is_not_routed_before_its_poll_is_answered(
    controller: Controller, stubs: StubWorkers
) -> None:
    name = stubs.url("held")
    gate = stubs.hold("held")
    thread, result = in_thread(lambda: controller.register(name, ["m"]))
    gate.wait_entered()
    assert controller.nothing_routed()  # claimed with its status, but not yet confirmed
    gate.release()
    thread.join(TIMEOUT_S)
    assert result[0].status_code == 200 and result[0].json() is None
    routed = controller.routed()
    assert routed["models"] == ["m"] and routed["address"] == name and routed["workers"] == [name]


def test_a_deregistration_during_confirmation_wins(controller: Controller, stubs: StubWorkers) -> None:
    name = stubs.url("leaves-early")
    gate = stubs.hold("leaves-early")
    thread, result = in_thread(lambda: controller.register(name, ["m"], instance_id="w1"))
    gate.wait_entered()
    assert controller.deregister(name, instance_id="intruder") is False
    assert controller.deregister(name, instance_id="w1") is True
    gate.release()
    thread.join(TIMEOUT_S)
    assert result[0].status_code == 409, result[0].text
    assert controller.nothing_routed()


# ---- polls that race a deregistration or a re-registration -----------------------------------------


def test_refresh_all_workers_never_brings_back_a_worker_that_deregistered(
    controller: Controller, stubs: StubWorkers
) -> None:
    name = stubs.url("refresh-race")
    assert controller.register(name, ["m"], instance_id="w1").status_code == 200
    gate = stubs.hold("refresh-race")
    thread, result = in_thread(lambda: controller.post("/refresh_all_workers"))
    gate.wait_entered()  # the refresh's poll of this worker is in flight
    assert controller.deregister(name, instance_id="w1") is True
    gate.release()  # ... and answers, as the worker still runs
    thread.join(TIMEOUT_S)
    assert result[0].status_code == 200 and result[0].json() == {"removed": []}
    assert controller.nothing_routed()
    assert name not in controller.app.state.registry


def test_refresh_all_workers_does_not_overwrite_a_worker_that_replaced_the_polled_one(
    controller: Controller, stubs: StubWorkers
) -> None:
    name = stubs.url("refresh-replaced", ["m"])
    assert controller.register(name, ["m"], instance_id="old").status_code == 200
    gate = stubs.hold("refresh-replaced")
    thread, result = in_thread(lambda: controller.post("/refresh_all_workers"))
    gate.wait_entered()
    assert controller.deregister(name, instance_id="old") is True
    assert controller.register(name, ["m"], instance_id="new").status_code == 200  # a restart
    gate.release()
    thread.join(TIMEOUT_S)
    assert result[0].status_code == 200
    assert controller.app.state.registry.get(name).instance_id == "new"
    assert controller.post("/receive_heart_beat", {"worker_name": name, "queue_length": 0,
                                                   "instance_id": "new"}).json() == {"exist": True}


def test_refresh_all_workers_failing_poll_does_not_remove_a_replacement(
    controller: Controller, stubs: StubWorkers
) -> None:
    name = stubs.url("refresh-fails")
    assert controller.register(name, ["m"], instance_id="old").status_code == 200
    gate = stubs.hold("refresh-fails")
    thread, result = in_thread(lambda: controller.post("/refresh_all_workers"))
    gate.wait_entered()
    assert controller.deregister(name, instance_id="old") is True
    assert controller.register(name, ["m"], instance_id="new").status_code == 200
    status = stubs.statuses.pop("refresh-fails")  # the held poll now answers 404: a failure
    gate.release()
    thread.join(TIMEOUT_S)
    stubs.statuses["refresh-fails"] = status
    assert result[0].json() == {"removed": []}
    assert controller.app.state.registry.get(name).instance_id == "new"


def test_the_sweeps_poll_never_brings_back_a_worker_that_left(stubs: StubWorkers) -> None:
    from llmplatform.controller.registry import WorkerRegistry
    from llmplatform.protocol.controller import WorkerStatus

    now = [0.0]
    registry = WorkerRegistry(heartbeat_expiration=10.0, clock=lambda: now[0])
    name = stubs.url("sweep-race")
    registry.register(name, WorkerStatus(model_names=["m"]), instance_id="w1")
    now[0] = 6.0  # quiet for more than half the expiration: the sweep polls it

    async def scenario() -> None:
        gate = stubs.hold("sweep-race")
        async with httpx.AsyncClient() as client:
            poll = asyncio.create_task(_poll_quiet_workers(registry, client, TIMEOUT_S))
            await asyncio.to_thread(gate.wait_entered)
            assert registry.remove(name)  # deregistered while the poll is in flight
            gate.release()
            await poll

    asyncio.run(scenario())
    assert name not in registry and registry.list_models() == []
