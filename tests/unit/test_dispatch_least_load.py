"""least_load dispatch and the controller's dispatcher over its registry, with exact expectations.

Time and randomness are injected: `FakeClock` pins heartbeat times, `FixedRandom` returns given
draws in order and raises if asked for one more (so a test fails if a pick that should be
decided by load is decided by chance).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from llmplatform.controller.__main__ import ControllerServiceSettings
from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.dispatch import Dispatcher, routed
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.protocol.controller import HeartbeatRequest, WorkerStatus
from llmplatform.routing.load import KV_CACHE_PRESSURE, RoutedWorker
from llmplatform.routing.policies import DispatchMethod, least_load_key, pick_worker

from tests.unit.controller_fakes import A, B, C, FakeClock, FixedRandom


def ours(
    name: str,
    *,
    running: int = 0,
    waiting: int = 0,
    capacity: int | None = 4,
    kv: float | None = 0.0,
    dispatched: int = 0,
    speed: int = 1,
) -> RoutedWorker:
    """One of our workers: reports running/waiting, KV usage and its batch capacity."""
    return RoutedWorker(
        worker_name=name,
        model_names=frozenset({"m"}),
        speed=speed,
        queue_length=running + waiting,
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        max_num_running=capacity,
        reported_at=0.0,
        num_dispatched=dispatched,
    )


def stock(name: str, *, queue_length: int = 0, speed: int = 1, dispatched: int = 0) -> RoutedWorker:
    """A stock FastChat worker: only queue_length and speed."""
    return RoutedWorker(worker_name=name, model_names=frozenset({"m"}), speed=speed,
                        queue_length=queue_length, num_running=None, num_waiting=None,
                        kv_cache_usage=None, max_num_running=None, reported_at=0.0,
                        num_dispatched=dispatched)


def pick(*candidates: RoutedWorker, draws: tuple[float, ...] = ()) -> str:
    picked = pick_worker(list(candidates), DispatchMethod.LEAST_LOAD, FixedRandom(*draws))
    assert picked is not None
    return picked.worker_name


# ---- the rank --------------------------------------------------------------------------------


def test_key_is_share_of_capacity_with_dispatches_since_heartbeat() -> None:
    assert least_load_key(ours(A, running=2, waiting=1, capacity=8, kv=0.25, dispatched=1)) == (
        False,
        Fraction(1, 2),
        0.25,
    )
    # Over capacity: requests wait, load above 1.
    assert least_load_key(ours(A, running=4, waiting=2, capacity=4)) == (False, Fraction(3, 2), 0.0)


def test_key_of_a_stock_worker_is_shortest_queues_load() -> None:
    assert least_load_key(stock(A, queue_length=3, speed=2, dispatched=1)) == (False, Fraction(2), 0.0)
    assert least_load_key(stock(A, queue_length=3, speed=0)) == (False, float("inf"), 0.0)


def test_key_marks_kv_pressure_from_the_threshold_on() -> None:
    assert least_load_key(ours(A, kv=KV_CACHE_PRESSURE))[0] is True
    assert least_load_key(ours(A, kv=0.89))[0] is False


# ---- picks -----------------------------------------------------------------------------------


def test_capacity_beats_raw_queue_length() -> None:
    # A runs 3 of 16 (3/16), B 1 of 2 (1/2): A is lighter although its queue is longer.
    big = ours(A, running=3, capacity=16)
    small = ours(B, running=1, capacity=2)
    assert pick(big, small) == A
    # shortest_queue, blind to capacity, picks the other one.
    picked = pick_worker([big, small], DispatchMethod.SHORTEST_QUEUE, FixedRandom())
    assert picked is not None and picked.worker_name == B


def test_dispatches_since_heartbeat_count_as_load() -> None:
    # Equal reports; A already got 2 requests the report cannot show yet: 2/4 > 1/4.
    assert pick(ours(A, running=0, dispatched=2), ours(B, running=1)) == B


def test_kv_pressure_is_avoided_unless_everyone_is_under_it() -> None:
    # A idle but its cache is 95% full; B three-quarters busy with room in its cache.
    assert pick(ours(A, running=0, kv=0.95), ours(B, running=3, kv=0.2)) == B
    # Both under pressure: load decides again.
    assert pick(ours(A, running=0, kv=0.95), ours(B, running=3, kv=0.9)) == A


def test_equal_load_prefers_the_emptier_kv_cache_without_a_draw() -> None:
    # 1/4 and 2/8 tie exactly; B has more free KV blocks. No draw is made.
    assert pick(ours(A, running=1, capacity=4, kv=0.5), ours(B, running=2, capacity=8, kv=0.3)) == B


@pytest.mark.parametrize(("draw", "expected"), [(0.0, A), (0.49, A), (0.5, C), (0.99, C)])
def test_exact_ties_are_broken_at_random(draw: float, expected: str) -> None:
    candidates = (
        ours(A, running=1, capacity=2, kv=0.1),
        ours(B, running=1, capacity=2, kv=0.2),  # same load, fuller cache: out of the tie
        ours(C, running=2, capacity=4, kv=0.1),
    )
    assert pick(*candidates, draws=(draw,)) == expected


def test_mixed_cluster_with_a_stock_worker() -> None:
    # The stock worker's load is queue_length / speed, on the same scale as ours.
    assert pick(stock(A, queue_length=0), ours(B, running=1, capacity=64)) == A
    assert pick(stock(A, queue_length=1), ours(B, running=63, capacity=64)) == B
    # A worker that reports running but not waiting falls back to its queue_length.
    partial = ours(A, running=0, capacity=4)
    partial = dataclasses.replace(partial, num_waiting=None, queue_length=3)
    assert least_load_key(partial) == (False, Fraction(3, 4), 0.0)


def test_zero_capacity_is_the_last_resort() -> None:
    assert pick(stock(A, speed=0), ours(B, running=40, capacity=4)) == B
    assert pick(stock(A, speed=0)) == A


# ---- the dispatcher and the registry ----------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> WorkerRegistry:
    return WorkerRegistry(heartbeat_expiration=10.0, clock=clock)


def status(capacity: int | None, **load: float) -> WorkerStatus:
    return WorkerStatus(model_names=["m"], max_num_running=capacity, **load)  # type: ignore[arg-type]


def test_dispatcher_default_over_workers_without_a_prefix_cache_is_least_load(
        registry: WorkerRegistry, clock: FakeClock) -> None:
    """The default, cache_aware, ranks workers that report no prefix cache by least_load alone;
    and a burst spreads out."""
    registry.register(A, status(4, num_running=0, num_waiting=0))
    registry.register(B, status(2, num_running=0, num_waiting=0))
    # loads (A/4, B/2): 0,0 tie -> draw 0.0 -> A; 1/4,0 -> B; 1/4,1/2 -> A; 2/4,1/2 tie -> draw
    # 0.99 -> B; 2/4,1 -> A; 3/4,1 -> A; 1,1 tie -> draw 0.0 -> A.
    dispatcher = Dispatcher(registry, rng=FixedRandom(0.0, 0.99, 0.0))
    assert dispatcher.method is DispatchMethod.CACHE_AWARE
    picks = [dispatcher.choose("m").worker_name for _ in range(7)]  # type: ignore[union-attr]
    assert picks == [A, B, A, B, A, A, A]
    assert dispatcher.dispatched() == {A: 5, B: 2}
    # The workers' own numbers are untouched: only the dispatch counter moved.
    assert registry.get(A).queue_length == 0  # type: ignore[union-attr]
    # A heartbeat replaces the estimate with the worker's report.
    clock.now += 1.0
    assert registry.heartbeat(A, 1, num_running=1, num_waiting=0, kv_cache_usage=0.1)
    info = registry.get(A)
    assert info is not None and info.max_num_running == 4  # capacity survives heartbeats
    assert dispatcher.dispatched() == {A: 0, B: 2}
    assert least_load_key(routed(info)) == (False, Fraction(1, 4), 0.1)
    assert dispatcher.choose("missing") is None


def test_every_method_records_dispatches(registry: WorkerRegistry) -> None:
    registry.register(A, status(None, num_running=0, num_waiting=0))
    for method in DispatchMethod:
        dispatcher = Dispatcher(registry, method, FixedRandom(0.5))
        assert dispatcher.choose("m").worker_name == A  # type: ignore[union-attr]
        assert dispatcher.dispatched() == {A: 1}


def test_registration_resets_dispatches_and_records_capacity(registry: WorkerRegistry,
                                                             clock: FakeClock) -> None:
    registry.register(A, status(8))
    dispatcher = Dispatcher(registry, DispatchMethod.LEAST_LOAD, FixedRandom())
    dispatcher.choose("m")
    assert dispatcher.dispatched() == {A: 1}
    clock.now += 1.0
    registry.register(A, status(16))
    info = registry.get(A)
    assert info is not None and info.max_num_running == 16
    assert dispatcher.dispatched() == {A: 0}


def test_aggregate_status_sums_capacity(registry: WorkerRegistry) -> None:
    registry.register(A, status(8))
    registry.register(B, status(None))
    registry.register(C, status(4))
    assert registry.aggregate_status().max_num_running == 12
    assert WorkerRegistry().aggregate_status().max_num_running is None


def test_protocol_capacity_is_optional_and_positive() -> None:
    assert WorkerStatus.model_validate({"model_names": ["m"]}).max_num_running is None
    with pytest.raises(ValueError):
        WorkerStatus.model_validate({"model_names": ["m"], "max_num_running": 0})
    # A heartbeat does not carry it (and ignores it if sent).
    beat = HeartbeatRequest.model_validate({"worker_name": A, "queue_length": 0, "max_num_running": 3})
    assert not hasattr(beat, "max_num_running")


def test_controller_defaults_to_cache_aware() -> None:
    assert ControllerConfig().dispatch_method is DispatchMethod.CACHE_AWARE
    assert ControllerServiceSettings.parse([]).dispatch_method is DispatchMethod.CACHE_AWARE
    for method in ("least_load", "shortest_queue", "lottery"):
        assert ControllerServiceSettings.parse(["--dispatch-method", method]).dispatch_method == method


def test_aggregate_queue_counts_dispatches_since_heartbeat(registry: WorkerRegistry,
                                                           clock: FakeClock) -> None:
    # A parent controller sees this controller's picks before its workers report them.
    registry.register(A, status(4, num_running=1, num_waiting=0, queue_length=1))
    dispatcher = Dispatcher(registry, DispatchMethod.LEAST_LOAD, FixedRandom())
    dispatcher.choose("m")
    dispatcher.choose("m")
    assert registry.aggregate_status(dispatcher.dispatched()).queue_length == 3
    clock.now += 1.0
    registry.heartbeat(A, 3, num_running=3, num_waiting=0)
    assert registry.aggregate_status(dispatcher.dispatched()).queue_length == 3


def test_shortest_queue_counts_dispatches_since_heartbeat() -> None:
    # Queues 1 and 2, but A got 2 requests since its report: (1+2)/1 > 2/1.
    picked = pick_worker([stock(A, queue_length=1, dispatched=2), stock(B, queue_length=2)],
                         DispatchMethod.SHORTEST_QUEUE, FixedRandom())
    assert picked is not None and picked.worker_name == B
