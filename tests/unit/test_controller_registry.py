"""The controller's registry and dispatch policies, with an injected clock and random source."""

from __future__ import annotations

import random

import pytest

from llmplatform.controller.dispatch import Dispatcher
from llmplatform.controller.registry import WorkerInfo, WorkerRegistry
from llmplatform.protocol.controller import (
    HeartbeatRequest,
    RegisterWorkerRequest,
    WorkerStatus,
)

from llmplatform.routing.load import RoutedWorker
from llmplatform.routing.policies import DispatchMethod, pick_worker

from tests.unit.controller_fakes import A, B, C, FakeClock, FixedRandom


def status(*models: str, speed: int = 1, queue_length: int = 0, **load: float) -> WorkerStatus:
    return WorkerStatus(model_names=list(models), speed=speed, queue_length=queue_length, **load)


def info(name: str, *, speed: int = 1, queue_length: int = 0) -> RoutedWorker:
    """A stock FastChat worker as routing sees it: only queue_length and speed."""
    return RoutedWorker(worker_name=name, model_names=frozenset({"m"}), speed=speed,
                        queue_length=queue_length, num_running=None, num_waiting=None,
                        kv_cache_usage=None, max_num_running=None, reported_at=0.0)


def pick_name(candidates: list[RoutedWorker], method: DispatchMethod, rng: object) -> str:
    picked = pick_worker(candidates, method, rng)  # type: ignore[arg-type]
    assert picked is not None
    return picked.worker_name


def queues(registry: WorkerRegistry, *names: str) -> tuple[int, ...]:
    return tuple(registry.get(name).queue_length for name in names)  # type: ignore[union-attr]


def dispatched(dispatcher: Dispatcher, *names: str) -> tuple[int, ...]:
    counts = dispatcher.dispatched()
    return tuple(counts[name] for name in names)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> WorkerRegistry:
    return WorkerRegistry(heartbeat_expiration=10.0, clock=clock)


# ---- registry ---------------------------------------------------------------------------------


def test_register_records_everything(registry: WorkerRegistry, clock: FakeClock) -> None:
    previous = registry.register(
        A, status("llama", speed=2, queue_length=3, num_running=1, num_waiting=2, kv_cache_usage=0.5),
        multimodal=True,
    )
    assert previous is None
    assert registry.get(A) == WorkerInfo(
        worker_name=A,
        model_names=("llama",),
        speed=2,
        queue_length=3,
        check_heart_beat=True,
        multimodal=True,
        last_heartbeat=1000.0,
        num_running=1,
        num_waiting=2,
        kv_cache_usage=0.5,
        generation=1,
    )
    assert A in registry and len(registry) == 1


def test_reregister_replaces_and_returns_previous(registry: WorkerRegistry, clock: FakeClock) -> None:
    registry.register(A, status("old", queue_length=5))
    clock.now += 4
    previous = registry.register(A, status("new"), check_heart_beat=False)
    assert previous is not None and previous.model_names == ("old",)
    current = registry.get(A)
    assert current is not None
    assert current.model_names == ("new",)
    assert current.queue_length == 0
    assert current.check_heart_beat is False
    assert current.last_heartbeat == 1004.0
    assert registry.list_models() == ["new"]
    assert len(registry) == 1


def test_heartbeat_updates_queue_and_load_facts(registry: WorkerRegistry, clock: FakeClock) -> None:
    registry.register(A, status("m", queue_length=1, num_running=7))
    clock.now += 3
    assert registry.heartbeat(A, 4, num_waiting=2) is True
    current = registry.get(A)
    assert current is not None
    assert (current.queue_length, current.last_heartbeat) == (4, 1003.0)
    # Replaced, not merged: a fact the worker stopped reporting is not kept stale.
    assert (current.num_running, current.num_waiting, current.kv_cache_usage) == (None, 2, None)


def test_heartbeat_unknown_worker_is_not_exist(registry: WorkerRegistry) -> None:
    assert registry.heartbeat(A, 0) is False
    assert A not in registry


def test_heartbeat_on_stale_unswept_entry_asks_to_reregister(
    registry: WorkerRegistry, clock: FakeClock
) -> None:
    registry.register(A, status("m"))
    clock.now += 10.5
    assert A in registry  # not swept yet
    assert registry.heartbeat(A, 0) is False
    assert A not in registry


def test_expire_exactly_at_boundary(registry: WorkerRegistry, clock: FakeClock) -> None:
    registry.register(A, status("m"))  # t = 1000
    registry.register(B, status("m"), check_heart_beat=False)
    clock.now = 1005.0
    registry.register(C, status("m"))  # t = 1005
    assert registry.expire(now=1010.0) == []  # A is exactly 10 s old: still live
    assert registry.list_models() == ["m"]
    assert registry.expire(now=1010.25) == [A]
    assert registry.expire(now=1015.0) == []
    assert registry.expire(now=1015.25) == [C]
    assert registry.expire(now=1e9) == []  # B does not heartbeat, never expires
    assert B in registry and len(registry) == 1


def test_expire_defaults_to_clock(registry: WorkerRegistry, clock: FakeClock) -> None:
    registry.register(A, status("m"))
    clock.now += 10
    assert registry.expire() == []
    clock.now += 0.5
    assert registry.expire() == [A]


def test_heartbeat_postpones_expiry(registry: WorkerRegistry, clock: FakeClock) -> None:
    registry.register(A, status("m"))
    clock.now += 8
    assert registry.heartbeat(A, 0)
    clock.now += 8
    assert registry.expire() == []
    clock.now += 2.5
    assert registry.expire() == [A]


def test_queries_hide_stale_workers_before_sweep(registry: WorkerRegistry, clock: FakeClock) -> None:
    registry.register(A, status("m", speed=1, queue_length=1))
    clock.now += 6
    registry.register(B, status("m", "x", speed=2, queue_length=2))
    clock.now += 5  # A is 11 s old, B 5 s
    assert registry.list_models() == ["m", "x"]
    assert [w.worker_name for w in registry.workers_for("m")] == [B]
    assert registry.aggregate_status() == status("m", "x", speed=2, queue_length=2)
    assert registry.is_live(B) and not registry.is_live(A)
    assert A in registry


def test_remove(registry: WorkerRegistry) -> None:
    registry.register(A, status("m"))
    assert registry.remove(A) is True
    assert registry.remove(A) is False
    assert registry.list_models() == []


def test_every_registration_is_a_new_generation_and_beats_keep_it(registry: WorkerRegistry) -> None:
    registry.register(A, status("m"))
    first = registry.get(A).generation  # type: ignore[union-attr]
    assert registry.heartbeat(A, 3)
    assert registry.get(A).generation == first  # type: ignore[union-attr]
    registry.register(A, status("m"))
    assert registry.get(A).generation > first  # type: ignore[union-attr]


def test_update_status_writes_only_over_the_polled_registration(
    registry: WorkerRegistry, clock: FakeClock
) -> None:
    registry.register(A, status("m", queue_length=1), multimodal=True, instance_id="one")
    polled = registry.get(A)
    assert polled is not None
    clock.now += 5
    assert registry.update_status(A, status("m", "n", queue_length=4, kv_cache_usage=0.25), polled.generation)
    info = registry.get(A)
    assert info is not None
    assert (info.model_names, info.queue_length, info.kv_cache_usage, info.last_heartbeat) == (
        ("m", "n"), 4, 0.25, 1005.0)
    assert (info.multimodal, info.instance_id, info.generation) == (True, "one", polled.generation)
    # Removed while the poll ran: the poll's answer does not bring the worker back.
    assert registry.remove(A)
    assert not registry.update_status(A, status("m"), polled.generation)
    assert A not in registry
    # Replaced while the poll ran: the answer about the old registration is dropped.
    registry.register(A, status("other"), instance_id="two")
    assert not registry.update_status(A, status("m"), polled.generation)
    assert registry.get(A).instance_id == "two" and registry.list_models() == ["other"]  # type: ignore[union-attr]


def test_remove_with_a_generation_removes_only_that_registration(registry: WorkerRegistry) -> None:
    registry.register(A, status("m"))
    old = registry.get(A).generation  # type: ignore[union-attr]
    registry.register(A, status("m"))
    assert registry.remove(A, generation=old) is False and A in registry
    assert registry.remove(A, generation=registry.get(A).generation) is True  # type: ignore[union-attr]
    assert A not in registry


def test_list_models_sorted_union_and_filters(registry: WorkerRegistry) -> None:
    registry.register(A, status("zeta", "alpha"))
    registry.register(B, status("alpha", "beta"))
    registry.register(C, status("vision"), multimodal=True)
    assert registry.list_models() == ["alpha", "beta", "vision", "zeta"]
    assert registry.list_models(multimodal=False) == ["alpha", "beta", "zeta"]
    assert registry.list_models(multimodal=True) == ["vision"]


def test_workers_for_is_sorted_by_name(registry: WorkerRegistry) -> None:
    registry.register(C, status("m"))
    registry.register(A, status("m"))
    registry.register(B, status("other"))
    assert [w.worker_name for w in registry.workers_for("m")] == [A, C]
    assert registry.workers_for("missing") == []


def test_aggregate_status(registry: WorkerRegistry) -> None:
    assert registry.aggregate_status() == WorkerStatus(model_names=[], speed=0, queue_length=0)
    registry.register(A, status("b", "a", speed=1, queue_length=3, num_running=2))
    registry.register(B, status("c", "a", speed=2, queue_length=4))
    registry.register(C, status("d", speed=1, queue_length=0, num_running=1, num_waiting=5))
    assert registry.aggregate_status() == WorkerStatus(
        model_names=["a", "b", "c", "d"], speed=4, queue_length=7, num_running=3, num_waiting=5
    )


def test_expiration_must_be_positive() -> None:
    with pytest.raises(ValueError):
        WorkerRegistry(heartbeat_expiration=0)


# ---- dispatch ---------------------------------------------------------------------------------


def test_no_candidates() -> None:
    for method in DispatchMethod:
        assert pick_worker([], method, FixedRandom()) is None


@pytest.mark.parametrize(
    ("draw", "expected"),
    # speeds 1, 3, 0, 2 -> slices [0,1) [1,4) [4,6) over total 6; draw*6 picks the slice.
    [(0.0, A), (0.16, A), (0.17, B), (0.5, B), (0.66, B), (0.7, "D"), (0.999, "D")],
)
def test_lottery_weighted_by_speed(draw: float, expected: str) -> None:
    candidates = [info(A, speed=1), info(B, speed=3), info(C, speed=0), info("D", speed=2)]
    picked = pick_worker(candidates, DispatchMethod.LOTTERY, FixedRandom(draw))
    assert picked is not None and picked.worker_name == expected


def test_lottery_all_speed_zero_is_uniform() -> None:
    candidates = [info(A, speed=0), info(B, speed=0)]
    assert pick_name(candidates, DispatchMethod.LOTTERY, FixedRandom(0.7)) == B


def test_lottery_frequencies_follow_speed() -> None:
    candidates = [info(A, speed=1), info(B, speed=3)]
    rng = random.Random(0)
    picks = [pick_name(candidates, DispatchMethod.LOTTERY, rng) for _ in range(4000)]
    assert 0.70 < picks.count(B) / len(picks) < 0.80


def test_shortest_queue_normalizes_by_speed() -> None:
    # loads: 4/1 = 4, 6/2 = 3, 5/1 = 5 -> B
    candidates = [info(A, queue_length=4), info(B, speed=2, queue_length=6), info(C, queue_length=5)]
    rng = FixedRandom()  # no tie: must not draw
    assert pick_name(candidates, DispatchMethod.SHORTEST_QUEUE, rng) == B


@pytest.mark.parametrize(("draw", "expected"), [(0.0, A), (0.49, A), (0.5, C), (0.99, C)])
def test_shortest_queue_ties_broken_by_rng(draw: float, expected: str) -> None:
    # loads: 1/2 and 2/4 tie exactly; B's 1/1 loses.
    candidates = [
        info(A, speed=2, queue_length=1),
        info(B, queue_length=1),
        info(C, speed=4, queue_length=2),
    ]
    picked = pick_worker(candidates, DispatchMethod.SHORTEST_QUEUE, FixedRandom(draw))
    assert picked is not None and picked.worker_name == expected


def test_shortest_queue_speed_zero_is_last_resort() -> None:
    candidates = [info(A, speed=0, queue_length=0), info(B, queue_length=100)]
    assert pick_name(candidates, DispatchMethod.SHORTEST_QUEUE, FixedRandom()) == B


def test_dispatcher_shortest_queue_increments_and_spreads_a_burst(registry: WorkerRegistry,
                                                                  clock: FakeClock) -> None:
    registry.register(A, status("m", queue_length=0))
    registry.register(B, status("m", queue_length=0))
    registry.register(C, status("other"))
    # queues (0,0) tie, draw 0.9 -> B; (0,1) -> A without a draw; (1,1) tie, draw 0.0 -> A.
    dispatcher = Dispatcher(registry, DispatchMethod.SHORTEST_QUEUE, FixedRandom(0.9, 0.0))
    picks = [dispatcher.choose("m").worker_name for _ in range(3)]  # type: ignore[union-attr]
    assert picks == [B, A, A]
    assert dispatched(dispatcher, A, B) == (2, 1)
    assert queues(registry, A, B) == (0, 0)  # the workers' own reports are left alone
    # The next heartbeat replaces the estimate with the worker's own count.
    clock.now += 1.0
    registry.heartbeat(A, 0)
    assert dispatched(dispatcher, A, B) == (0, 1)
    assert dispatcher.choose("missing") is None


def test_dispatcher_lottery_does_not_touch_queues(registry: WorkerRegistry) -> None:
    registry.register(A, status("m", speed=1, queue_length=5))
    registry.register(B, status("m", speed=1, queue_length=0))
    dispatcher = Dispatcher(registry, DispatchMethod.LOTTERY, FixedRandom(0.2, 0.7))
    assert [dispatcher.choose("m").worker_name for _ in range(2)] == [A, B]  # type: ignore[union-attr]
    assert queues(registry, A, B) == (5, 0)


def test_dispatch_method_parses_cli_strings() -> None:
    assert DispatchMethod("lottery") is DispatchMethod.LOTTERY
    assert DispatchMethod("shortest_queue") is DispatchMethod.SHORTEST_QUEUE


# ---- protocol models --------------------------------------------------------------------------


def test_messages_ignore_extra_fields_and_default_like_fastchat() -> None:
    req = RegisterWorkerRequest.model_validate(
        {"worker_name": A, "worker_status": {"model_names": ["m"], "future_field": 1}, "x": 1}
    )
    assert req.check_heart_beat is True and req.multimodal is False
    assert req.worker_status == WorkerStatus(model_names=["m"], speed=1, queue_length=0)
    beat = HeartbeatRequest.model_validate({"worker_name": A, "queue_length": 2, "kv_cache_usage": 0.25})
    assert (beat.queue_length, beat.kv_cache_usage, beat.num_running) == (2, 0.25, None)
