"""Routing follows the workers that are alive: a dead one disappears within the configured
expiry, one that leaves on purpose at once, and a restarted controller gets every worker back
within one heartbeat while the gateway keeps answering (routing locally, it even serves while
the controller is down)."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from llmplatform.openai_api.settings import RoutingMode
from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import (
    MODEL, controller_app, gateway_app, list_models, services, start_service, start_worker,
    serve_worker, worker_app,
)
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.polling import wait_until
from tests.processes import free_port
from tests.stub_workers import stub_workers

EXPIRATION_S = 2.0
HEARTBEAT_S = 1.0


def address_for(controller_url: str) -> str:
    return httpx.post(f"{controller_url}/get_worker_address", json={"model": MODEL},
                      timeout=5).json()["address"]


def test_killed_worker_leaves_routing_within_the_configured_expiry(tiny_model_dir, tmp_path):
    port = free_port()
    controller_url = f"http://127.0.0.1:{port}"
    controller = start_service("llmplatform.controller",
                               ["--port", str(port), "--heartbeat-expiration", str(EXPIRATION_S)],
                               tmp_path / "controller.log", f"{controller_url}/health", controller_url)
    with services(controller), services(start_worker(tiny_model_dir, controller_url, tmp_path)) as (worker,):
        wait_for_models(controller_url, [MODEL])
        assert address_for(controller_url) == worker.url
        worker.kill()  # no deregistration, no more heartbeats: only expiry can remove it
        killed_at = time.monotonic()
        wait_until(lambda: address_for(controller_url) == "" and MODEL not in list_models(controller_url),
                   timeout_s=EXPIRATION_S + 3, interval_s=0.05, what="the dead worker out of routing")
        # Its last heartbeat was at most one interval (0.5 s) before the kill; the default
        # expiry (10 s) would not pass.
        assert time.monotonic() - killed_at <= EXPIRATION_S + 2.5


@pytest.mark.parametrize("routing", list(RoutingMode))
def test_controller_restart_is_survived(tiny_model_dir, new_client, routing):
    port = free_port()
    controller_url = f"http://127.0.0.1:{port}"
    llm = paged_tiny_llm(tiny_model_dir)
    with contextlib.ExitStack() as stack:
        controller = contextlib.ExitStack()
        stack.callback(controller.close)
        controller.enter_context(serve_in_thread(controller_app(), port=port))
        gateway = gateway_app(controller_url, routing=routing)
        gateway_url = stack.enter_context(serve_in_thread(gateway))
        stack.enter_context(serve_worker(worker_app(llm, controller_url, heartbeat_interval=HEARTBEAT_S)))
        wait_for_models(controller_url, [MODEL])
        if routing is RoutingMode.LOCAL:
            wait_until(lambda: MODEL in gateway.state.routing_table.models(), timeout_s=10,
                       what="the gateway's read of the worker list")
        client = new_client(gateway_url, timeout=30)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason

        controller.close()  # the controller goes away, with everything it knew
        if routing is RoutingMode.LOCAL:
            # The gateway goes on from its last worker list (for 10 refresh intervals, at
            # least 5 s; tests/unit/test_gateway_worker_routing.py has it dropped after that).
            reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert reply.choices[0].finish_reason
        else:
            with pytest.raises(openai.InternalServerError) as down:  # a clean answer, not a hang
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert down.value.status_code == 503

        controller.enter_context(serve_in_thread(controller_app(), port=port))  # a fresh one
        restarted = time.monotonic()
        wait_until(lambda: MODEL in list_models(controller_url), timeout_s=HEARTBEAT_S + 5,
                   what="the worker registered again")
        # The worker's next heartbeat hears "unknown" and registers at once.
        assert time.monotonic() - restarted <= HEARTBEAT_S + 2.5
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"


def test_worker_that_leaves_is_out_of_routing_at_once(tiny_model_dir):
    llm = paged_tiny_llm(tiny_model_dir)
    # A long expiry: only the worker's own deregistration can remove it quickly.
    with serve_in_thread(controller_app(heartbeat_expiration=60.0)) as controller_url:
        with serve_worker(worker_app(llm, controller_url)) as worker_url:
            wait_for_models(controller_url, [MODEL])
            assert address_for(controller_url) == worker_url
        # The worker stopped (its lifespan ended): gone now, not in 60 s.
        assert address_for(controller_url) == "" and MODEL not in list_models(controller_url)
        again = httpx.post(f"{controller_url}/deregister_worker", json={"worker_name": worker_url},
                           timeout=5)
        assert again.status_code == 200 and again.json() == {"removed": False}


def test_get_worker_address_excludes_workers_already_tried():
    with contextlib.ExitStack() as stack:
        controller_url = stack.enter_context(serve_in_thread(controller_app()))
        # Two workers that answer only the controller's status poll (never sent a request).
        stubs = stack.enter_context(stub_workers())
        names = [stubs.url("one", [MODEL]), stubs.url("two", [MODEL])]
        for name in names:
            response = httpx.post(f"{controller_url}/register_worker", timeout=5, json={
                "worker_name": name, "check_heart_beat": True,
                "worker_status": {"model_names": [MODEL], "speed": 1, "queue_length": 0}})
            assert response.status_code == 200, response.text

        def pick(exclude: list[str]) -> str:
            return httpx.post(f"{controller_url}/get_worker_address", timeout=5,
                              json={"model": MODEL, "exclude": exclude}).json()["address"]

        assert {pick([names[0]]) for _ in range(10)} == {names[1]}
        assert {pick([names[1] + "/"]) for _ in range(10)} == {names[0]}
        assert pick(names) == ""
        assert pick([]) in names
