"""cache_aware dispatch with an injected clock and load: exact expectations, no servers."""

from __future__ import annotations

import dataclasses

import pytest

from llmplatform.routing.cache_aware import (
    CHUNK_CHARS,
    CacheAwareConfig,
    Reason,
    RouteHint,
    prefix_hashes,
    session_hash,
)
from llmplatform.controller.dispatch import Dispatcher
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.protocol.controller import WorkerStatus
from llmplatform.routing.load import RoutedWorker
from llmplatform.routing.policies import DispatchMethod, DispatchPolicy, pick_worker
from tests.unit.controller_fakes import A, B, C, FakeClock, FixedRandom

SYSTEM_1 = "You are a pirate. " * 40  # 720 characters: 11 full chunks
SYSTEM_2 = "You answer in French only. " * 30


def worker(name: str, *, outstanding: int = 0, kv: float = 0.1, epoch: str | None = "e0",
           capacity: int = 8, caching: bool = True) -> RoutedWorker:
    return RoutedWorker(worker_name=name, model_names=frozenset({"m"}), speed=1,
                        queue_length=outstanding, num_running=outstanding, num_waiting=0,
                        kv_cache_usage=kv, max_num_running=capacity, reported_at=0.0,
                        cache_epoch=epoch, prefix_cache_queries=0 if caching else None)


def policy(clock: FakeClock, **config: object) -> DispatchPolicy:
    # Draws only break exact least_load ties; 0.0 takes the first tied candidate.
    return DispatchPolicy(DispatchMethod.CACHE_AWARE, FixedRandom(*[0.0] * 10_000),
                          cache_aware=CacheAwareConfig(**config), clock=clock)


def hint(text: str, session: str | None = None) -> RouteHint:
    return RouteHint.of(text, session)


def test_prefix_hashes_chain_full_chunks_only() -> None:
    text = "x" * (3 * CHUNK_CHARS + 10)
    hashes = prefix_hashes(text)
    assert len(hashes) == 3
    assert len(set(hashes)) == 3  # equal chunks, different positions: the chain tells them apart
    assert prefix_hashes(text[:2 * CHUNK_CHARS]) == hashes[:2]
    assert prefix_hashes("y" + text[1:])[0] != hashes[0]
    assert all(0 <= h < 2**63 for h in hashes)
    assert prefix_hashes("x" * 10) == ()
    assert len(prefix_hashes("x" * 10_000, max_chunks=4)) == 4
    assert session_hash("alice") == session_hash("alice") != session_hash("bob")


def test_longest_match_wins_over_load_within_the_threshold() -> None:
    p = policy(FakeClock(), balance_threshold=4)
    first = p.pick([worker(A), worker(B), worker(C)], hint(SYSTEM_1 + "question one"))
    assert (first.worker.worker_name, first.reason) == (A, Reason.NO_MATCH)  # a tie: first drawn
    # B comes to hold the first 4 chunks of SYSTEM_1 (A was too busy for that request).
    short = p.pick([worker(A, outstanding=9), worker(B), worker(C, outstanding=1)], hint(SYSTEM_1[:300]))
    assert (short.worker.worker_name, short.reason) == (B, Reason.LOAD_OVERRIDE)
    assert short.matched_chars == 0  # what B was believed to hold of it: nothing
    decision = p.pick([worker(A, outstanding=4), worker(B), worker(C)], hint(SYSTEM_1 + "question two"))
    assert (decision.worker.worker_name, decision.reason) == (A, Reason.AFFINITY)
    assert decision.matched_chars == len(SYSTEM_1) // CHUNK_CHARS * CHUNK_CHARS
    shorter = p.pick([worker(A, outstanding=4), worker(B), worker(C)], hint(SYSTEM_1[:280] + "zzzz"))
    assert shorter.worker.worker_name in (A, B) and shorter.reason is Reason.AFFINITY
    assert shorter.worker.worker_name == B  # equal matches (4 chunks): the less loaded of the two


def test_load_beyond_the_threshold_overrides_the_match() -> None:
    clock = FakeClock()
    p = policy(clock, balance_threshold=2, cold_balance_threshold=2)
    p.pick([worker(A), worker(B)], hint(SYSTEM_1 + "q1"))  # A owns SYSTEM_1
    kept = p.pick([worker(A, outstanding=3), worker(B, outstanding=1)], hint(SYSTEM_1 + "q2"))
    assert (kept.worker.worker_name, kept.reason) == (A, Reason.AFFINITY)  # 3 - 1 = 2: within
    moved = p.pick([worker(A, outstanding=4), worker(B, outstanding=1)], hint(SYSTEM_1 + "q3"))
    assert (moved.worker.worker_name, moved.reason) == (B, Reason.LOAD_OVERRIDE)
    # Now both hold it: the longest matches tie, and least_load chooses between them.
    both = p.pick([worker(A, outstanding=4), worker(B, outstanding=2)], hint(SYSTEM_1 + "q4"))
    assert (both.worker.worker_name, both.reason) == (B, Reason.AFFINITY)


def _systems(count: int) -> list[str]:
    return [f"System prompt number {i}: you are assistant {i}. " * 20 for i in range(count)]


def test_a_cold_prefix_waits_for_its_worker_up_to_the_cold_threshold() -> None:
    """One prefix of many (at most one worker's share of the traffic): moving it would compute
    it again elsewhere, so it stays with its worker up to cold_balance_threshold."""
    p = policy(FakeClock(), balance_threshold=2, cold_balance_threshold=6)
    systems = _systems(8)
    owner = {s: p.pick([worker(A), worker(B, outstanding=i % 2)], hint(s + "first")).worker.worker_name
             for i, s in enumerate(systems)}
    for system in systems:  # every prefix seen twice: each has 1/8 of the traffic
        p.pick([worker(A), worker(B)], hint(system + "second"))
    system = next(s for s in systems if owner[s] == A)
    load = {A: 7, B: 1}  # 6 ahead: beyond balance_threshold, within the cold one
    kept = p.pick([worker(A, outstanding=load[A]), worker(B, outstanding=load[B])], hint(system + "third"))
    assert (kept.worker.worker_name, kept.reason) == (A, Reason.AFFINITY)
    moved = p.pick([worker(A, outstanding=8), worker(B, outstanding=1)], hint(system + "fourth"))
    assert (moved.worker.worker_name, moved.reason) == (B, Reason.LOAD_OVERRIDE)  # 7 ahead


def test_a_hot_prefix_spreads_to_a_second_worker() -> None:
    """A prefix with more than one worker's share of the recent requests needs more than one
    worker: once it is hot, the next request goes to the other worker if that one is no busier
    (before any load override would), and from then on load decides between the two."""
    clock = FakeClock()
    p = policy(clock, balance_threshold=2, cold_balance_threshold=100, heat_half_life=1.0)
    hot, other = _systems(2)
    p.pick([worker(A), worker(B)], hint(hot + "q0"))  # A owns it
    p.pick([worker(A, outstanding=1), worker(B)], hint(other + "q0"))  # B owns the other
    # Two of three requests: not yet more than half of a full window of requests (3.4 here).
    early = p.pick([worker(A, outstanding=2), worker(B, outstanding=1)], hint(hot + "q1"))
    assert (early.worker.worker_name, early.reason) == (A, Reason.AFFINITY)
    busier = p.pick([worker(A, outstanding=2), worker(B, outstanding=3)], hint(hot + "q2"))
    assert (busier.worker.worker_name, busier.reason) == (A, Reason.AFFINITY)  # B is busier
    spread = p.pick([worker(A, outstanding=2), worker(B, outstanding=1)], hint(hot + "q3"))
    assert (spread.worker.worker_name, spread.reason) == (B, Reason.SPREAD)
    assert spread.matched_chars == 0  # B computes it once
    both = p.pick([worker(A, outstanding=3), worker(B, outstanding=2)], hint(hot + "q4"))
    assert (both.worker.worker_name, both.reason) == (B, Reason.AFFINITY)
    again = p.pick([worker(A, outstanding=1), worker(B, outstanding=2)], hint(hot + "q5"))
    assert (again.worker.worker_name, again.reason) == (A, Reason.AFFINITY)


def test_a_hot_prefix_spreads_to_as_many_workers_as_its_share_fills() -> None:
    """80% of the requests over 4 workers: ceil(3.2) = 4 of them hold it in the end; a prefix
    with 30% of them stays on its 2 workers (ceil(1.2))."""
    p = policy(FakeClock(), balance_threshold=8, cold_balance_threshold=8, heat_half_life=1.0)
    hot, warm, *others = _systems(12)
    workers = [A, B, C, "http://127.0.0.1:4"]
    sequence = [hot if i % 10 < 8 else others[i % 10 - 8] for i in range(60)]
    holders: dict[str, set[str]] = {}
    for i, system in enumerate(sequence):
        # The worker that was picked last is the busiest: an idle one is always available.
        decision = p.pick([worker(w, outstanding=1 if w in holders.get(system, ()) else 0) for w in workers],
                          hint(system + f"q{i}"))
        holders.setdefault(system, set()).add(decision.worker.worker_name)
    assert holders[hot] == set(workers)
    p2 = policy(FakeClock(), balance_threshold=8, cold_balance_threshold=8, heat_half_life=1.0)
    sequence = [warm if i % 10 < 3 else others[i % 10] for i in range(60)]
    holders = {}
    for i, system in enumerate(sequence):
        decision = p2.pick([worker(w, outstanding=1 if w in holders.get(system, ()) else 0) for w in workers],
                           hint(system + f"q{i}"))
        holders.setdefault(system, set()).add(decision.worker.worker_name)
    assert len(holders[warm]) == 2


def test_heat_is_recent_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix that was hot cools down as other traffic takes over (its count halves every
    heat_half_life x N requests, whatever the clock says), and the counts kept are bounded."""
    import llmplatform.routing.cache_aware as cache_aware

    clock = FakeClock()
    systems = _systems(4)
    p = policy(clock, balance_threshold=2, cold_balance_threshold=100, heat_half_life=2.0)
    for _ in range(6):  # systems[0] alone: hot
        p.pick([worker(A), worker(B)], hint(systems[0] + "q"))
    clock.now += 300.0  # time alone cools nothing (within the entries' TTL): only requests do
    assert p.pick([worker(A, outstanding=1), worker(B)], hint(systems[0] + "q")).reason is Reason.SPREAD
    p2 = policy(clock, balance_threshold=2, cold_balance_threshold=100, heat_half_life=2.0)
    for _ in range(6):
        p2.pick([worker(A), worker(B)], hint(systems[0] + "q"))
    for _ in range(4):  # 12 requests of the others: three half-lives (2 x 2 workers) each
        for system in systems[1:]:
            p2.pick([worker(A), worker(B)], hint(system + "q"))
    cold = p2.pick([worker(A, outstanding=1), worker(B)], hint(systems[0] + "q"))
    assert (cold.worker.worker_name, cold.reason) == (A, Reason.AFFINITY)
    monkeypatch.setattr(cache_aware, "MAX_HEAT_ENTRIES", 5)
    for i in range(20):
        p2.pick([worker(A), worker(B)], hint(f"unrelated {i} " * 30))
    assert p2.cache_aware is not None and len(p2.cache_aware._heat.counts) == 5


def test_kv_pressure_overrides_the_match() -> None:
    p = policy(FakeClock(), balance_threshold=100)
    p.pick([worker(A), worker(B)], hint(SYSTEM_1))
    decision = p.pick([worker(A, kv=0.95), worker(B, outstanding=5)], hint(SYSTEM_1 + "q"))
    assert (decision.worker.worker_name, decision.reason) == (B, Reason.LOAD_OVERRIDE)


def test_entries_age_out() -> None:
    clock = FakeClock(1000.0)
    p = policy(clock, entry_ttl_s=60.0)
    p.pick([worker(A), worker(B)], hint(SYSTEM_1))  # A
    clock.now += 59.0
    assert p.pick([worker(A, outstanding=1), worker(B)], hint(SYSTEM_1 + "q")).reason is Reason.AFFINITY
    clock.now += 59.0  # 59 s since the last routing refreshed it: still held
    assert p.pick([worker(A, outstanding=1), worker(B)], hint(SYSTEM_1 + "q")).worker.worker_name == A
    clock.now += 61.0
    late = p.pick([worker(A, outstanding=1), worker(B)], hint(SYSTEM_1 + "q"))
    assert (late.worker.worker_name, late.reason) == (B, Reason.NO_MATCH)
    assert p.cache_aware is not None and p.cache_aware.num_chunks(A) == 0  # expired, not kept


def test_memory_per_worker_is_bounded_and_keeps_prefixes_matchable() -> None:
    clock = FakeClock()
    p = policy(clock, max_chunks_per_worker=16)
    long_prompt = "".join(f"line {i:04d} of a long shared document......................\n"
                          for i in range(40))  # 40 chunks
    p.pick([worker(A)], hint(long_prompt))
    assert p.cache_aware is not None and p.cache_aware.num_chunks(A) == 16
    # The tail went first: the first 16 chunks still match from the root.
    decision = p.pick([worker(A), worker(B)], hint(long_prompt))
    assert (decision.worker.worker_name, decision.matched_chars) == (A, 16 * CHUNK_CHARS)
    for i in range(10):
        clock.now += 1
        p.pick([worker(A)], hint(f"unrelated prompt number {i} " * 10))
        assert p.cache_aware.num_chunks(A) <= 16


def test_a_restarted_or_reset_worker_is_forgotten() -> None:
    p = policy(FakeClock())
    p.pick([worker(A), worker(B)], hint(SYSTEM_1, "s1"))
    assert p.pick([worker(A, outstanding=1), worker(B)], hint(SYSTEM_1)).worker.worker_name == A
    # A new epoch (another process, or a reported prefix-cache reset): its tree is gone.
    restarted = p.pick([worker(A, outstanding=1, epoch="e1"), worker(B)], hint(SYSTEM_1))
    assert (restarted.worker.worker_name, restarted.reason) == (B, Reason.NO_MATCH)
    # ...and so is the session that pointed at it.
    session = p.pick([worker(A, epoch="e1"), worker(B, outstanding=1)], hint("hi", "s1"))
    assert session.reason is Reason.NO_MATCH


def test_registry_epoch_moves_with_the_instance_and_resets() -> None:
    clock = FakeClock()
    registry = WorkerRegistry(clock=clock)
    status = WorkerStatus(model_names=["m"], prefix_cache_resets=0)
    registry.register(A, status, instance_id="one")
    first = registry.get(A).cache_epoch
    assert first is not None and "one" not in first  # the id itself is never listed
    registry.heartbeat(A, 0, prefix_cache_resets=0)
    assert registry.get(A).cache_epoch == first
    registry.heartbeat(A, 0, prefix_cache_resets=1)
    assert registry.get(A).cache_epoch not in (None, first)
    registry.register(A, status, instance_id="two")
    assert registry.get(A).cache_epoch not in (None, first)


def test_sessions_stick_within_the_threshold_and_move_beyond_it() -> None:
    p = policy(FakeClock(), balance_threshold=2)
    first = p.pick([worker(A), worker(B)], hint("turn one", "alice"))
    assert first.worker.worker_name == A
    # Another prompt entirely (no prefix match anywhere), same session: A again.
    again = p.pick([worker(A, outstanding=2), worker(B)], hint("something else", "alice"))
    assert (again.worker.worker_name, again.reason) == (A, Reason.SESSION)
    moved = p.pick([worker(A, outstanding=3), worker(B)], hint("a third", "alice"))
    assert (moved.worker.worker_name, moved.reason) == (B, Reason.LOAD_OVERRIDE)
    after = p.pick([worker(A), worker(B, outstanding=1)], hint("a fourth", "alice"))
    assert (after.worker.worker_name, after.reason) == (B, Reason.SESSION)  # follows the move


def test_without_a_hint_cache_aware_is_least_load() -> None:
    p = policy(FakeClock())
    decision = p.pick([worker(A, outstanding=3), worker(B, outstanding=1)])
    assert (decision.worker.worker_name, decision.reason) == (B, Reason.NO_MATCH)


def test_retain_forgets_workers_gone_from_the_registry() -> None:
    p = policy(FakeClock())
    p.pick([worker(A)], hint(SYSTEM_1))
    p.retain({B})
    assert p.cache_aware is not None and p.cache_aware.num_chunks(A) == 0


def test_other_methods_give_the_load_reason_and_pick_worker_refuses_cache_aware() -> None:
    least = DispatchPolicy(DispatchMethod.LEAST_LOAD, FixedRandom())
    decision = least.pick([worker(A, outstanding=2), worker(B)], hint(SYSTEM_1))
    assert (decision.worker.worker_name, decision.reason) == (B, Reason.LOAD)
    with pytest.raises(ValueError, match="DispatchPolicy"):
        pick_worker([worker(A)], DispatchMethod.CACHE_AWARE, FixedRandom())


def test_dispatcher_routes_by_prefix_and_counts_dispatches() -> None:
    clock = FakeClock()
    registry = WorkerRegistry(clock=clock)
    for name in (A, B):
        registry.register(name, WorkerStatus(model_names=["m"], max_num_running=8, num_running=0,
                                             num_waiting=0, prefix_cache_queries=0,
                                             prefix_cache_resets=0), instance_id=name)
    dispatcher = Dispatcher(registry, DispatchMethod.CACHE_AWARE, FixedRandom(0.0, 0.0),
                            cache_aware=CacheAwareConfig(balance_threshold=4))
    owners = {}
    for system in (SYSTEM_1, SYSTEM_2):
        owners[system] = dispatcher.decide("m", hint=hint(system + "first")).worker.worker_name
    assert set(owners.values()) == {A, B}  # the second new prefix goes to the idler worker
    for system, owner in owners.items():
        decision = dispatcher.decide("m", hint=hint(system + "again"))
        assert (decision.worker.worker_name, decision.reason) == (owner, Reason.AFFINITY)
    assert dispatcher.dispatched() == {A: 2, B: 2}
    assert dispatcher.decide("other-model", hint=hint(SYSTEM_1)) is None


@pytest.mark.parametrize("field,value", [("balance_threshold", -1), ("cold_balance_threshold", -1),
                                         ("heat_half_life", 0), ("entry_ttl_s", 0),
                                         ("max_chunks_per_worker", 0), ("max_sessions", 0)])
def test_config_is_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CacheAwareConfig(), **{field: value})


def test_workers_without_a_prefix_cache_are_ranked_by_load_alone() -> None:
    """hf workers, stock FastChat workers and paged ones with prefix caching off report no
    prefix-cache counters: affinity to them would cost balance for nothing."""
    p = policy(FakeClock(), balance_threshold=100, cold_balance_threshold=100)
    plain = [worker(A, caching=False), worker(B, caching=False)]
    first = p.pick(plain, hint(SYSTEM_1 + "q1", session="alice"))
    assert (first.worker.worker_name, first.reason) == (A, Reason.NO_CACHE)
    again = p.pick([worker(A, caching=False, outstanding=1), worker(B, caching=False)],
                   hint(SYSTEM_1 + "q2", session="alice"))
    assert (again.worker.worker_name, again.reason) == (B, Reason.NO_CACHE)
    assert p.cache_aware is not None and p.cache_aware.num_chunks(A) == 0
    # Mixed: only the caching worker is matched; the other is never preferred for a prefix.
    mixed = [worker(A, caching=False), worker(B, outstanding=1)]
    to_b = p.pick(mixed, hint(SYSTEM_2 + "q1"))
    assert (to_b.worker.worker_name, to_b.reason) == (A, Reason.NO_MATCH)  # by load: A idler
    p.pick([worker(A, caching=False, outstanding=2), worker(B)], hint(SYSTEM_2 + "q2"))  # B, by load
    kept = p.pick([worker(A, caching=False), worker(B, outstanding=3)], hint(SYSTEM_2 + "q3"))
    assert (kept.worker.worker_name, kept.reason) == (B, Reason.AFFINITY)
    assert p.cache_aware.num_chunks(A) == 0
