"""`--routing local`: the gateway serves requests without asking the controller per request.

A real controller, fake workers (tests/integration/fake_worker.py) and gateways, each a uvicorn
server on 127.0.0.1, driven with the official client. The controller counts its
`/get_worker_address` calls (`llmplatform:controller_worker_address_requests_total`): with local
routing, once the gateway has read the worker list, that count must not move.

Gateways here refresh every 60 s: the read at startup is the only one while a test runs, so what
the table knows is fixed, and a worker registered later can only be found through the
controller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi import FastAPI

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.openai_api import GatewaySettings, create_app
from llmplatform.openai_api.settings import RoutingMode
from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import FirstCandidate
from tests.integration.fake_worker import FULL_REPLY, USER, FakeWorkerState, make_fake_worker, register_worker
from tests.observability.scrape import scrape, value
from tests.polling import wait_until

MODEL = "routed-model"
LATE_MODEL = "late-model"
FAILOVER_MODEL = "failover-model"
NUM_REQUESTS = 6


def address_requests(controller: str) -> float:
    """How many times the controller has been asked `/get_worker_address`."""
    return value(scrape(controller), "llmplatform:controller_worker_address_requests_total") or 0.0


def routing_decisions(gateway: str, source: str) -> float:
    return value(scrape(gateway), "llmplatform:gateway_routing_decisions_total", source=source) or 0.0


@pytest.fixture(scope="module")
def controller() -> Iterator[str]:
    with serve_in_thread(create_controller_app(ControllerConfig())) as url:
        yield url


@pytest.fixture(scope="module")
def workers(controller: str) -> Iterator[list[FakeWorkerState]]:
    """Two fake workers serving MODEL, registered before any gateway starts."""
    with contextlib.ExitStack() as stack:
        states = []
        for _ in range(2):
            app, state = make_fake_worker([MODEL])
            register_worker(controller, stack.enter_context(serve_in_thread(app)), [MODEL])
            states.append(state)
        yield states


@contextlib.contextmanager
def gateway(controller: str, routing: RoutingMode, **settings: Any) -> Iterator[tuple[str, FastAPI]]:
    app = create_app(GatewaySettings(controller_address=controller, routing=routing,
                                     worker_refresh_interval=60.0, **settings))
    with serve_in_thread(app) as url:
        if routing is RoutingMode.LOCAL:
            wait_until(lambda: MODEL in app.state.routing_table.models(), timeout_s=10,
                       what="the gateway's first read of the worker list")
        yield url, app


def ask(url: str, model: str = MODEL, n: int = NUM_REQUESTS) -> None:
    """`n` requests through the official client, chat and completions, streamed and not."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)
    for i in range(n):
        if i % 2:
            reply = client.chat.completions.create(model=model, messages=USER, max_tokens=20)
            assert reply.choices[0].message.content == FULL_REPLY
        else:
            chunks = list(client.completions.create(model=model, prompt="Hi", stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL_REPLY
    client.close()


def test_local_routing_serves_without_asking_the_controller(controller, workers) -> None:
    with gateway(controller, RoutingMode.LOCAL) as (url, _):
        before = [len(w.params) for w in workers]
        asked = address_requests(controller)
        ask(url)
        assert address_requests(controller) == asked, "the gateway asked the controller per request"
        assert routing_decisions(url, "table") == NUM_REQUESTS
        # One request at a time: each ended (and came off the table's load) before the next
        # was picked, so the workers tie every time; the spreading of a burst by the table's
        # own picks is tested in tests/unit/test_gateway_worker_routing.py.
        assert sum(len(w.params) - b for w, b in zip(workers, before)) == NUM_REQUESTS
        # The default method, cache_aware, over workers that report no prefix cache: load only.
        assert value(scrape(url), "llmplatform:gateway_dispatch_decisions_total",
                     policy="cache_aware", reason="no_cache") == NUM_REQUESTS


def test_controller_routing_asks_the_controller_for_every_request(controller, workers) -> None:
    with gateway(controller, RoutingMode.CONTROLLER) as (url, app):
        assert app.state.routing_table is None
        asked = address_requests(controller)
        ask(url)
        assert address_requests(controller) == asked + NUM_REQUESTS
        assert routing_decisions(url, "controller") == NUM_REQUESTS


def test_a_worker_registered_after_the_read_is_served_at_once(controller, workers) -> None:
    with gateway(controller, RoutingMode.LOCAL) as (url, app), contextlib.ExitStack() as stack:
        late_app, late = make_fake_worker([LATE_MODEL])
        register_worker(controller, stack.enter_context(serve_in_thread(late_app)), [LATE_MODEL])
        assert LATE_MODEL not in app.state.routing_table.models()
        asked = address_requests(controller)
        ask(url, LATE_MODEL, n=2)
        assert len(late.params) == 2
        assert address_requests(controller) == asked + 2  # through the controller, at once
        with pytest.raises(openai.NotFoundError):  # and an unknown model is still a 404
            ask(url, "no-such-model", n=1)


def test_a_killed_worker_is_failed_over_and_the_request_answered(controller, workers) -> None:
    with contextlib.ExitStack() as stack:
        servers: dict[str, contextlib.ExitStack] = {}
        states: dict[str, FakeWorkerState] = {}
        for _ in range(2):
            app, state = make_fake_worker([FAILOVER_MODEL])
            server = stack.enter_context(contextlib.ExitStack())
            worker_url = server.enter_context(serve_in_thread(app))
            register_worker(controller, worker_url, [FAILOVER_MODEL])
            servers[worker_url], states[worker_url] = server, state
        doomed, survivor = sorted(servers)
        # The gateway breaks ties with draws of 0: it picks the first worker by name, `doomed`.
        settings = GatewaySettings(controller_address=controller, worker_refresh_interval=60.0)
        gateway_app = create_app(settings, rng=FirstCandidate())
        url = stack.enter_context(serve_in_thread(gateway_app))
        wait_until(lambda: FAILOVER_MODEL in gateway_app.state.routing_table.models(), timeout_s=10,
                   what="the gateway's first read of the worker list")
        servers[doomed].close()  # stopped: connections refused; the controller still lists it
        asked = address_requests(controller)

        ask(url, FAILOVER_MODEL, n=1)
        assert len(states[survivor].params) == 1
        # Two picks from the table (the dead worker, then the other), none from the controller.
        assert routing_decisions(url, "table") == 2
        # The dead worker is marked down: the next request goes straight to the survivor.
        ask(url, FAILOVER_MODEL, n=1)
        assert routing_decisions(url, "table") == 3 and len(states[survivor].params) == 2
        assert address_requests(controller) == asked
