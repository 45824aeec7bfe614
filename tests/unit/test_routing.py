"""routing/: the load estimate and the router's table rules, with a fake clock and exact
expectations. (The policies' rankings: test_dispatch_least_load.py, test_dispatch_cache_aware.py;
the gateway reading listings into a router: test_gateway_worker_routing.py.)"""

from __future__ import annotations

import pytest

from llmplatform.routing.cache_aware import CacheAwareConfig, Reason, RouteHint
from llmplatform.routing.load import LoadEstimate, RoutedWorker, outstanding_requests
from llmplatform.routing.policies import DispatchMethod
from llmplatform.routing.router import Router

from tests.unit.controller_fakes import A, B, FakeClock, FixedRandom

PROMPT = "You are a pirate. " * 40


def worker(name: str, *, running: int = 0, waiting: int = 0, reported_at: float = 0.0,
           dispatched: int = 0, capacity: int = 4, caching: bool = False) -> RoutedWorker:
    return RoutedWorker(worker_name=name, model_names=frozenset({"m"}), speed=1,
                        queue_length=running + waiting, num_running=running, num_waiting=waiting,
                        kv_cache_usage=0.0, max_num_running=capacity, reported_at=reported_at,
                        num_dispatched=dispatched, cache_epoch="e" if caching else None,
                        prefix_cache_queries=0 if caching else None)


# ---- the load estimate --------------------------------------------------------------------------


def test_requests_sent_since_the_report_count_until_a_newer_report() -> None:
    clock = FakeClock(10.0)
    load = LoadEstimate(clock)
    load.reported(A, 9.0)
    load.sent(A)
    clock.now = 11.0
    load.sent(A)
    assert load.estimate(worker(A, dispatched=1)).num_dispatched == 3  # others' 1 + own 2
    load.reported(A, 9.0)  # the same report again: nothing dropped
    assert load.net_sent(A) == 2
    load.reported(A, 8.0)  # an older one (a late listing): nothing dropped either
    assert load.net_sent(A) == 2
    load.reported(A, 10.0)  # newer: it counts the request sent at 10.0, not the one at 11.0
    assert load.net_sent(A) == 1


def test_requests_that_ended_come_off_the_sent_ones_then_the_report_waiting_first() -> None:
    clock = FakeClock()
    load = LoadEstimate(clock)
    reported = worker(A, running=2, waiting=1, dispatched=1)
    load.sent(A)
    for _ in range(4):  # the own pick, the others' pick, the waiting one, one running
        load.ended(reported)
    estimated = load.estimate(reported)
    assert (estimated.num_dispatched, estimated.num_waiting, estimated.num_running,
            estimated.queue_length) == (0, 0, 1, 1)
    assert outstanding_requests(estimated) == 1
    load.ended(reported)
    load.ended(reported)  # nothing left to take off: not kept as credit against later picks
    assert outstanding_requests(load.estimate(reported)) == 0
    assert load.net_sent(A) == 1 - 5
    load.sent(A)
    assert outstanding_requests(load.estimate(reported)) == 1


def test_retain_forgets_the_workers_not_listed() -> None:
    load = LoadEstimate(FakeClock(1.5))
    load.reported(A, 5.0)
    load.sent(A)
    load.sent(B)
    load.retain({B})
    assert (load.net_sent(A), load.net_sent(B)) == (0, 1)
    load.reported(A, 1.0)  # A is new again: its first report is taken, however old
    load.sent(A)  # at 1.5
    load.reported(A, 2.0)
    assert load.net_sent(A) == 0


# ---- the router's table ------------------------------------------------------------------------


def test_a_router_without_a_method_or_table_decides_nothing() -> None:
    router = Router(rng=FixedRandom(), clock=FakeClock())
    assert router.method is None and not router.usable and router.pick("m") is None
    router.configure(DispatchMethod.LEAST_LOAD)
    assert router.pick("m") is None  # configured, no table yet
    router.update([worker(A)], requested_at=0.0)
    assert router.usable and router.pick("m") == A
    router.clear()
    assert router.method is None and router.workers() == [] and router.pick("m") is None


def test_picks_spread_a_burst_and_a_newer_report_replaces_them() -> None:
    clock = FakeClock(100.0)
    router = Router(DispatchMethod.LEAST_LOAD, rng=FixedRandom(0.0, 0.0), clock=clock)
    router.update([worker(A, reported_at=99.0), worker(B, reported_at=99.0)], requested_at=100.0)
    assert [router.pick("m") for _ in range(4)] == [A, B, A, B]  # ties drawn for A
    clock.now = 101.0
    # A reported after the picks (and counts 1 of them still running); B's report is the same.
    router.update([worker(A, running=1, reported_at=100.5), worker(B, reported_at=99.0)],
                  requested_at=101.0)
    assert (router.load.net_sent(A), router.load.net_sent(B)) == (0, 2)
    assert router.pick("m") == A  # A 1/4 < B 2/4


def test_excluded_and_down_workers_are_not_candidates() -> None:
    clock = FakeClock(100.0)
    router = Router(DispatchMethod.LEAST_LOAD, rng=FixedRandom(), clock=clock)
    router.update([worker(A), worker(B, running=3)], requested_at=100.0)
    assert router.pick("m", exclude=[A + "/"]) == B
    read_asked = clock.now
    clock.now = 100.5
    router.mark_down(A + "/")
    assert router.pick("m") == B
    # A read asked for before the failure knows nothing of it: A stays down.
    router.update([worker(A), worker(B, running=3)], requested_at=read_asked)
    assert router.pick("m") == B
    router.update([worker(A), worker(B, running=3)], requested_at=100.6)  # asked after the failure
    assert router.pick("m") == A
    assert router.pick("other") is None


def test_a_table_older_than_max_age_is_dropped() -> None:
    clock = FakeClock(100.0)
    router = Router(DispatchMethod.LEAST_LOAD, rng=FixedRandom(), clock=clock, max_age=5.0)
    router.update([worker(A)], requested_at=100.0)
    clock.now = 105.0
    assert router.pick("m") == A  # exactly the bound: still used
    clock.now = 105.01
    assert router.pick("m") is None and not router.usable and router.method is None
    with pytest.raises(ValueError, match="max_age"):
        Router(max_age=0.0)


def test_without_max_age_a_table_never_goes_stale() -> None:
    clock = FakeClock(100.0)
    router = Router(DispatchMethod.LEAST_LOAD, rng=FixedRandom(), clock=clock)
    router.update([worker(A)], requested_at=100.0)
    clock.now = 1e9
    assert router.pick("m") == A


def test_request_ended_lowers_the_estimate_of_a_listed_worker_only() -> None:
    router = Router(DispatchMethod.LEAST_LOAD, rng=FixedRandom(), clock=FakeClock())
    router.update([worker(A, running=2), worker(B, running=1)], requested_at=0.0)
    router.request_ended(A + "/")
    router.request_ended(A)
    router.request_ended("http://unknown:1")
    assert router.load.net_sent(A) == -2 and router.pick("m") == A  # 0/4 < 1/4


def test_configure_keeps_what_cache_aware_learned_while_the_method_stays() -> None:
    router = Router(DispatchMethod.CACHE_AWARE, rng=FixedRandom(*[0.0] * 10), clock=FakeClock())
    router.update([worker(A, caching=True), worker(B, caching=True)], requested_at=0.0)
    hint = RouteHint.of(PROMPT + "q1")
    first = router.decide("m", hint=hint)
    assert first is not None and (first.worker.worker_name, first.reason) == (A, Reason.NO_MATCH)
    router.configure(DispatchMethod.CACHE_AWARE, CacheAwareConfig(balance_threshold=5))
    again = router.decide("m", hint=RouteHint.of(PROMPT + "q2"))
    assert again is not None and (again.worker.worker_name, again.reason) == (A, Reason.AFFINITY)
    assert router.policy is not None and router.policy.cache_aware is not None
    assert router.policy.cache_aware.config.balance_threshold == 5
    router.configure(DispatchMethod.LEAST_LOAD)  # another method: a new policy
    assert router.policy.method is DispatchMethod.LEAST_LOAD and router.policy.cache_aware is None
