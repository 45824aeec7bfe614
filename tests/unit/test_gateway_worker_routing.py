"""The gateway's routing table (routing.Router, read by openai_api/worker_routing.py), with exact
expectations.

Time and randomness are injected as in the controller's tests (`FakeClock`, `FixedRandom`, which
fails a test that draws where none was scripted). The controller side is the real controller app
reached in-process through `httpx.ASGITransport`, so "the table picks as the controller would" is
checked against the controller itself, not against a copy of its rules.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.routing.policies import DispatchMethod
from llmplatform.errors import ModelNotFoundError
from llmplatform.openai_api.worker_routing import (
    MIN_STALE_AFTER_S,
    RECHECK_UNSUPPORTED_S,
    RouteSource,
    TableRefresher,
    max_table_age,
    update_from_listing,
)
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.failover import with_failover
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.openai_api.worker_wire import WorkerUnavailableError
from llmplatform.protocol.controller import ListWorkersResponse, WorkerDescription, WorkerStatus
from llmplatform.routing.router import Router

from tests.unit.controller_fakes import A, B, C, FakeClock, FixedRandom

CONTROLLER = "http://controller"
MAX_AGE_S = 10.0


def described(name: str, *, models: tuple[str, ...] = ("m",), running: int = 0, waiting: int = 0,
              capacity: int | None = 4, kv: float | None = 0.0, age: float = 0.0,
              dispatched: int = 0, speed: int = 1) -> WorkerDescription:
    """One worker as the controller's /list_workers describes it."""
    return WorkerDescription(worker_name=name, model_names=list(models), speed=speed,
                             queue_length=running + waiting, num_running=running,
                             num_waiting=waiting, kv_cache_usage=kv, last_heartbeat_age_s=age,
                             max_num_running=capacity, num_dispatched=dispatched)


def listing(*workers: WorkerDescription, method: str | None = "least_load") -> ListWorkersResponse:
    return ListWorkersResponse(workers=list(workers), dispatch_method=method)


def table_with(*workers: WorkerDescription, method: str = "least_load", rng: Any = None,
               clock: FakeClock | None = None) -> Router:
    table = Router(max_age=MAX_AGE_S, clock=clock or FakeClock(), rng=rng or FixedRandom())
    update_from_listing(table, listing(*workers, method=method), requested_at=0.0)
    return table


# ---- picking as the controller would --------------------------------------------------------------


def test_least_load_prefers_the_smaller_share_of_capacity() -> None:
    # A runs 3 of 16, B 1 of 2: A is lighter although its queue is longer.
    table = table_with(described(A, running=3, capacity=16), described(B, running=1, capacity=2))
    assert table.pick("m") == A


def test_shortest_queue_uses_queue_over_speed() -> None:
    table = table_with(described(A, running=3, speed=2), described(B, running=2, speed=1),
                       method="shortest_queue")
    assert table.pick("m") == A  # 3/2 < 2/1


def test_lottery_draws_from_the_injected_source() -> None:
    workers = (described(A, speed=1), described(B, speed=3))
    table = table_with(*workers, method="lottery", rng=FixedRandom(0.2, 0.3, 0.99))
    assert [table.pick("m") for _ in range(3)] == [A, B, B]  # A owns [0, 1/4), B [1/4, 1)


def test_only_workers_serving_the_model_are_candidates() -> None:
    table = table_with(described(A, models=("x",)), described(B, models=("m", "y"), running=3))
    assert table.pick("m") == B
    assert table.pick("nothing") is None
    assert table.models() == {"x", "m", "y"}


async def register(app: Any, name: str, **status: Any) -> None:
    """Put a worker into the controller's registry. Directly: over /register_worker the controller
    would first confirm it with the worker's own /worker_get_status, and these workers are only
    names (confirmation: tests/security/test_worker_confirmation.py)."""
    app.state.registry.register(name, WorkerStatus.model_validate(
        {"model_names": ["m"], "speed": 1, "queue_length": 0, **status}))


@pytest.mark.parametrize("method", list(DispatchMethod))
async def test_a_burst_is_spread_exactly_as_the_controller_spreads_it(method: DispatchMethod) -> None:
    """Two controllers with the same workers and the same seed: one answers /get_worker_address
    twelve times, the other's /list_workers fills a table that picks twelve times. Same picks,
    in the same order: the same method, ranking, tie-breaking and dispatch counting."""
    facts = {A: dict(num_running=1, num_waiting=0, max_num_running=4, kv_cache_usage=0.5,
                     queue_length=1, speed=2),
             B: dict(num_running=0, num_waiting=0, max_num_running=2, kv_cache_usage=0.1),
             C: dict(queue_length=2, speed=1)}  # a stock FastChat worker: no load facts
    picks: dict[str, list[str]] = {}
    for side in ("controller", "table"):
        app = create_controller_app(ControllerConfig(dispatch_method=method), clock=FakeClock(),
                                    rng=random.Random(7))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=CONTROLLER) as http:
            for name, status in facts.items():
                await register(app, name, **status)
            if side == "controller":
                answers = [await http.post("/get_worker_address", json={"model": "m"})
                           for _ in range(12)]
                picks[side] = [answer.json()["address"] for answer in answers]
            else:
                client = WorkerClient(http, GatewaySettings(controller_address=CONTROLLER))
                table = Router(max_age=MAX_AGE_S, clock=FakeClock(), rng=random.Random(7))
                fetched = await client.list_workers()
                assert fetched is not None and fetched.dispatch_method == method.value
                update_from_listing(table, fetched, requested_at=0.0)
                picks[side] = [table.pick("m") or "" for _ in range(12)]
    assert picks["table"] == picks["controller"]
    assert len(set(picks["table"])) > 1, "a burst is spread, not piled onto one worker"


# ---- own picks between reads ------------------------------------------------------------------------


def test_own_picks_count_as_load_until_a_newer_heartbeat_reports_them() -> None:
    clock = FakeClock(100.0)
    idle = (described(A, age=1.0), described(B, age=1.0))
    table = table_with(*idle, clock=clock, rng=FixedRandom(0.0, 0.0))  # two ties, for A
    # Both idle with capacity 4: each pick makes the picked one busier, so they alternate.
    assert [table.pick("m") for _ in range(4)] == [A, B, A, B]
    # A read without a newer heartbeat (ages grew with the clock) keeps the picks counted ...
    clock.now += 1.0
    update_from_listing(table, listing(described(A, age=2.0), described(B, age=2.0)),
                        requested_at=clock.now)
    update_from_listing(table, listing(described(A, age=2.0, running=1), described(B, age=2.0)),
                        requested_at=clock.now)
    assert table.pick("m") == B  # A: 1 reported + 2 own = 3/4 > B: 2/4
    # ... a read with a heartbeat taken after them drops them: the report includes them.
    clock.now += 1.0
    update_from_listing(table, listing(described(A, age=0.5, running=2),
                                       described(B, age=0.5, running=3)), requested_at=clock.now)
    assert table.pick("m") == A  # 2/4 < 3/4, the own picks are gone


def test_requests_that_ended_since_the_heartbeat_come_off_the_load() -> None:
    """A worker whose requests finish between heartbeats (short answers, cached prompts) must
    not keep looking as busy as its last report plus every pick since: bursts would alternate
    between the workers, each looking full in turn."""
    clock = FakeClock(100.0)
    table = table_with(described(A, age=0.5, running=3), described(B, age=0.5, running=2), clock=clock,
                       rng=FixedRandom(0.99))  # one tie below, for B
    assert table.pick("m") == B  # 2/4 < 3/4
    clock.now += 0.1
    for _ in range(3):  # A's three reported requests end (the stream's end tells the table)
        table.request_ended(A + "/")
    assert table.pick("m") == A  # A: 3 - 3 = 0 < B: 2 + 1
    assert table.pick("m") == A  # A: 1 < B: 3
    for _ in range(3):  # A's two picks end, and one more: nothing left to take off, not kept
        table.request_ended(A)
    assert [table.pick("m") for _ in range(4)] == [A, A, A, B]  # 3 picks: A 3 = B 3, a tie
    # A read with a heartbeat after the ends drops them: the report no longer counts them.
    clock.now += 0.5
    update_from_listing(table, listing(described(A, age=0.1, running=3),
                                       described(B, age=0.1, running=2)), requested_at=clock.now)
    assert table.pick("m") == B  # 2/4 < 3/4: A's ends before the heartbeat are not taken off again
    table.request_ended("http://unknown:1")  # not listed: ignored


def test_the_controllers_own_dispatches_count_too() -> None:
    table = table_with(described(A, dispatched=3), described(B, running=2))
    assert table.pick("m") == B  # 3/4 > 2/4


# ---- exclusions, failures, staleness ----------------------------------------------------------------


def test_excluded_workers_are_not_picked() -> None:
    table = table_with(described(A), described(B, running=3))
    assert table.pick("m", exclude=[A]) == B
    assert table.pick("m", exclude=[A + "/"]) == B
    assert table.pick("m", exclude=[A, B]) is None  # the caller asks the controller


def test_a_worker_marked_down_is_skipped_until_a_read_that_started_after_the_failure() -> None:
    clock = FakeClock(100.0)
    table = table_with(described(A), described(B, running=3), clock=clock)
    read_started = clock.now
    clock.now += 0.1
    table.mark_down(A)
    assert table.pick("m") == B
    # A read asked for before the failure knows nothing of it: A stays down.
    update_from_listing(table, listing(described(A), described(B, running=3)),
                        requested_at=read_started)
    assert table.pick("m") == B
    # The next read lists A again: usable again.
    update_from_listing(table, listing(described(A), described(B, running=3)),
                        requested_at=clock.now + 0.1)
    assert table.pick("m") == A
    table.mark_down(A)
    table.mark_down(B)
    assert table.pick("m") is None


def test_a_stale_table_is_dropped_after_its_bound() -> None:
    clock = FakeClock(100.0)
    table = table_with(described(A), clock=clock)
    clock.now += MAX_AGE_S
    assert table.pick("m") == A  # exactly the bound: still used
    clock.now += 0.01
    assert table.pick("m") is None and not table.usable and table.models() == set()
    update_from_listing(table, listing(described(A)), requested_at=clock.now)
    assert table.pick("m") == A


def test_the_age_bound_follows_the_refresh_interval() -> None:
    assert max_table_age(1.0) == 10.0
    assert max_table_age(0.1) == MIN_STALE_AFTER_S


@pytest.mark.parametrize("method", [None, "round_robin"])
def test_a_listing_without_a_known_dispatch_method_cannot_drive_routing(method: str | None) -> None:
    table = table_with(described(A))
    update_from_listing(table, listing(described(A), method=method), requested_at=0.0)
    assert not table.usable and table.pick("m") is None


# ---- with a controller over HTTP (scripted) ---------------------------------------------------------


class ScriptedController:
    """A controller answering from a script, counting /get_worker_address calls and their bodies."""

    def __init__(self, *, list_workers: Callable[[], httpx.Response], address: str) -> None:
        self.list_workers = list_workers
        self.address = address
        self.address_requests: list[dict[str, Any]] = []
        self.secrets: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.secrets.append(request.headers.get("x-llmplatform-secret"))
        if request.method == "GET" and request.url.path == "/list_workers":
            return self.list_workers()
        if request.url.path == "/get_worker_address":
            body = json.loads(request.content)
            self.address_requests.append(body)
            return httpx.Response(200, json={"address": "" if self.address in body.get("exclude", [])
                                             else self.address})
        if request.url.path == "/list_models":
            return httpx.Response(200, json={"models": ["m"]})
        return httpx.Response(404, json={"detail": "Not Found"})


def listed(*workers: WorkerDescription) -> Callable[[], httpx.Response]:
    return lambda: httpx.Response(200, content=listing(*workers).model_dump_json())


@dataclass
class Gateway:
    """A gateway's WorkerClient and table refresher over a scripted controller."""

    client: WorkerClient
    refresher: TableRefresher
    sources: list[RouteSource]
    """Where each pick came from, in order (what the routing-decision metric counts)."""


@pytest.fixture
async def make_gateway() -> AsyncIterator[Callable[..., Gateway]]:
    clients: list[httpx.AsyncClient] = []

    def make(controller: ScriptedController, *, clock: FakeClock | None = None,
             rng: Any = None) -> Gateway:
        # The app sets the cluster secret on its one HTTP client, as here.
        http = httpx.AsyncClient(transport=httpx.MockTransport(controller),
                                 headers={"X-LLMPlatform-Secret": "s"})
        clients.append(http)
        clock = clock or FakeClock()
        table = Router(max_age=MAX_AGE_S, clock=clock, rng=rng or FixedRandom())
        sources: list[RouteSource] = []
        client = WorkerClient(http, GatewaySettings(controller_address=CONTROLLER), routes=table,
                              on_route=sources.append)
        return Gateway(client, TableRefresher(table, client.list_workers, interval=1.0, clock=clock),
                       sources)

    yield make
    for http in clients:
        await http.aclose()


async def test_after_a_read_requests_never_ask_the_controller(make_gateway) -> None:
    controller = ScriptedController(list_workers=listed(described(A), described(B, running=2)),
                                    address=C)
    gateway = make_gateway(controller, rng=FixedRandom(0.99))
    assert await gateway.refresher.refresh() == 1.0
    # A at 0/4 then 1/4 (its own picks) against B's 2/4; then a tie, drawn for B.
    assert [await gateway.client.worker_address("m") for _ in range(3)] == [A, A, B]
    assert controller.address_requests == []
    assert gateway.sources == [RouteSource.TABLE] * 3
    assert controller.secrets == ["s"]  # the cluster secret went along on /list_workers


async def test_what_the_table_does_not_know_is_asked_of_the_controller(make_gateway) -> None:
    controller = ScriptedController(list_workers=listed(described(A)), address=C)
    gateway = make_gateway(controller)
    assert await gateway.client.worker_address("m") == C  # before the first read
    await gateway.refresher.refresh()
    assert await gateway.client.worker_address("new-model") == C  # e.g. registered since
    assert [body["model"] for body in controller.address_requests] == ["m", "new-model"]
    assert gateway.sources == [RouteSource.CONTROLLER] * 2
    controller.address = ""
    with pytest.raises(ModelNotFoundError):
        await gateway.client.worker_address("nope")  # the controller's answer, unchanged


@pytest.mark.parametrize("status", [404, 405])
async def test_a_stock_controller_is_asked_on_every_request(make_gateway, status: int) -> None:
    controller = ScriptedController(list_workers=lambda: httpx.Response(status, json={"detail": "no"}),
                                    address=A)
    gateway = make_gateway(controller)
    assert await gateway.refresher.refresh() == RECHECK_UNSUPPORTED_S  # asked again only rarely
    assert [await gateway.client.worker_address("m") for _ in range(3)] == [A, A, A]
    assert len(controller.address_requests) == 3
    assert gateway.sources == [RouteSource.CONTROLLER] * 3


async def test_a_controller_that_stops_answering_leaves_the_table_in_use_for_a_while(make_gateway) -> None:
    clock = FakeClock(100.0)
    answers = [listed(described(A))]

    def list_workers() -> httpx.Response:
        if answers:
            return answers.pop()()
        raise httpx.ConnectError("refused")

    controller = ScriptedController(list_workers=list_workers, address=A)
    gateway = make_gateway(controller, clock=clock)
    await gateway.refresher.refresh()
    clock.now += 5.0
    assert await gateway.refresher.refresh() == 1.0  # failed: logged, the table kept
    assert await gateway.client.worker_address("m") == A and controller.address_requests == []
    clock.now += MAX_AGE_S
    assert await gateway.client.worker_address("m") == A  # dropped: asked of the controller
    assert len(controller.address_requests) == 1
    assert gateway.sources == [RouteSource.TABLE, RouteSource.CONTROLLER]


async def test_failover_marks_the_worker_down_and_picks_another_from_the_table(make_gateway) -> None:
    controller = ScriptedController(list_workers=listed(described(A), described(B, running=1)),
                                    address=C)
    gateway = make_gateway(controller)
    client = gateway.client
    await gateway.refresher.refresh()
    tried: list[str] = []

    async def attempt(address: str) -> str:
        tried.append(address)
        if address == A:
            raise WorkerUnavailableError(f"The worker at {address} is unreachable.")
        return address

    assert await with_failover(client, "m", attempt) == B
    assert tried == [A, B] and controller.address_requests == []
    # A stays down for the next request too (until the next read).
    assert await with_failover(client, "m", attempt) == B
    assert tried == [A, B, B]


async def test_failover_asks_the_controller_when_the_table_has_no_other_worker(make_gateway) -> None:
    controller = ScriptedController(list_workers=listed(described(A)), address=A)
    gateway = make_gateway(controller)
    client = gateway.client
    await gateway.refresher.refresh()

    async def attempt(address: str) -> str:
        raise WorkerUnavailableError(f"The worker at {address} is unreachable.")

    with pytest.raises(WorkerUnavailableError):  # the last worker's error, as before
        await with_failover(client, "m", attempt)
    assert controller.address_requests == [{"model": "m", "exclude": [A]}]


# ---- admin actions reach every worker ---------------------------------------------------------------


async def test_worker_addresses_lists_every_live_worker_of_the_model() -> None:
    app = create_controller_app(ControllerConfig(), clock=FakeClock(), rng=random.Random(0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=CONTROLLER) as http:
        await register(app, A)
        await register(app, B)
        await register(app, C, model_names=["other"])
        client = WorkerClient(http, GatewaySettings(controller_address=CONTROLLER))
        assert sorted(await client.worker_addresses("m")) == sorted([A, B])
        assert await client.worker_addresses("other") == [C]
        with pytest.raises(ModelNotFoundError):
            await client.worker_addresses("nope")


async def test_worker_addresses_behind_a_stock_controller_is_its_pick() -> None:
    from fastapi import FastAPI

    stock = FastAPI()  # FastChat's controller: no /list_workers

    @stock.post("/get_worker_address")
    async def get_worker_address() -> dict[str, str]:
        return {"address": B}

    @stock.post("/list_models")
    async def list_models() -> dict[str, list[str]]:
        return {"models": ["m"]}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(stock), base_url=CONTROLLER) as http:
        client = WorkerClient(http, GatewaySettings(controller_address=CONTROLLER))
        assert await client.worker_addresses("m") == [B]
