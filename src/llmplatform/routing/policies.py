"""The dispatch methods: which of the candidate workers serves the next request for a model.

`pick_worker` is a pure function over candidate snapshots (anything with the load facts of
:class:`DispatchCandidate`; the router hands it :class:`~llmplatform.routing.load.RoutedWorker`s
with their estimated load, router.py). Randomness is injected (anything with `random() -> float`,
e.g. `random.Random(seed)`) so tests can pin exact outcomes.

least_load ranks each candidate by, in order:

1. KV-cache pressure: a worker whose last report has `kv_cache_usage >= KV_CACHE_PRESSURE` would
   have to preempt or queue a new sequence, so it is chosen only when every candidate is under
   pressure.
2. Load, the fraction of its batch capacity in use:
   `(num_running + num_waiting + num_dispatched) / max_num_running`, where `num_dispatched`
   counts the requests sent it since its last heartbeat (load.py's estimate: a burst between two
   heartbeats otherwise sees the same stale numbers and piles onto one worker). Above 1 means
   requests wait. A worker that does not report running/waiting (stock FastChat) counts its
   `queue_length` instead, and one without a capacity divides by `speed`: for a stock worker
   that is exactly shortest_queue's `queue_length / speed`. Capacity 0 is infinite load.
3. `kv_cache_usage` (unreported counts as 0): of two equally busy workers, the one with more
   free KV blocks.

Exact ties on all three are broken at random. Loads are exact fractions, so 1/4 and 2/8 tie.

cache_aware (cache_aware.py, the default) prefers the worker most likely to hold the request's
prompt prefix (or its session's worker) and falls back on least_load past a balance threshold;
among workers without a prefix cache it is least_load. It keeps state,
so it is reached through a :class:`DispatchPolicy` (which every method is, for its caller: each
router holds one), not `pick_worker`.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Collection, Sequence
from fractions import Fraction
from typing import Protocol, TypeVar

from llmplatform.routing.cache_aware import (
    NO_HINT,
    CacheAwareConfig,
    CacheAwarePolicy,
    Decision,
    Reason,
    RouteHint,
)
from llmplatform.routing.load import (
    KV_CACHE_PRESSURE,
    DispatchCandidate,
    outstanding_requests,
    under_kv_pressure,
)


class DispatchMethod(str, enum.Enum):
    LOTTERY = "lottery"
    """Random, weighted by `speed`."""
    SHORTEST_QUEUE = "shortest_queue"
    """Argmin of `queue_length / speed`, ties broken at random (FastChat's default)."""
    LEAST_LOAD = "least_load"
    """Lowest share of batch capacity in use, avoiding full KV caches (see the module doc)."""
    CACHE_AWARE = "cache_aware"
    """The worker holding the longest prefix of the prompt, within a balance threshold of the
    least loaded (see cache_aware.py)."""


DEFAULT_DISPATCH_METHOD = DispatchMethod.CACHE_AWARE


class RandomSource(Protocol):
    def random(self) -> float:
        """A float uniformly drawn from [0, 1)."""
        ...


C = TypeVar("C", bound=DispatchCandidate)


def pick_worker(candidates: Sequence[C], method: DispatchMethod, rng: RandomSource) -> C | None:
    """Pick one of `candidates` (None if there are none). Does not change any state."""
    if not candidates:
        return None
    if method is DispatchMethod.LOTTERY:
        return _lottery(candidates, rng)
    if method is DispatchMethod.SHORTEST_QUEUE:
        return _shortest_queue(candidates, rng)
    if method is DispatchMethod.LEAST_LOAD:
        return _least_load(candidates, rng)
    if method is DispatchMethod.CACHE_AWARE:
        raise ValueError("cache_aware keeps state: pick through a DispatchPolicy")
    raise ValueError(f"unknown dispatch method {method!r}")


def _uniform_index(n: int, rng: RandomSource) -> int:
    # min() guards against a source that returns exactly 1.0.
    return min(int(rng.random() * n), n - 1)


def _lottery(candidates: Sequence[C], rng: RandomSource) -> C:
    """Candidate i wins with probability speed_i / sum(speed).

    The draw `u * total` falls in candidate i's slice [sum(speed_<i), sum(speed_<=i)).
    If every speed is 0 there is nothing to weight by, so the pick is uniform.
    """
    total = sum(c.speed for c in candidates)
    if total <= 0:
        return candidates[_uniform_index(len(candidates), rng)]
    point = rng.random() * total
    upper = 0
    for candidate in candidates:
        upper += candidate.speed
        if point < upper:
            return candidate
    # Only reachable through float rounding at the top end; the last weighted worker owns it.
    return next(c for c in reversed(candidates) if c.speed > 0)


def _shortest_queue(candidates: Sequence[C], rng: RandomSource) -> C:
    """Lowest `queue_length / speed` wins; exact fractions so 1/2 and 2/4 tie.

    The queue includes the requests dispatched since the worker's heartbeat (FastChat too
    counts its own picks until the next heartbeat). A speed-0 worker has an infinite
    normalized queue: chosen only if all are speed 0.
    """

    def load(c: DispatchCandidate) -> Fraction | float:
        queue_length = c.queue_length + c.num_dispatched
        return Fraction(queue_length, c.speed) if c.speed > 0 else math.inf

    return _argmin([load(c) for c in candidates], candidates, rng)


LeastLoadKey = tuple[bool, Fraction | float, float]


def least_load_key(worker: DispatchCandidate) -> LeastLoadKey:
    """least_load's rank of one worker: lower is better (see the module doc)."""
    kv_cache_usage = worker.kv_cache_usage if worker.kv_cache_usage is not None else 0.0
    outstanding = outstanding_requests(worker)
    capacity = worker.max_num_running if worker.max_num_running is not None else worker.speed
    load: Fraction | float = Fraction(outstanding, capacity) if capacity > 0 else math.inf
    return (kv_cache_usage >= KV_CACHE_PRESSURE, load, kv_cache_usage)


def _least_load(candidates: Sequence[C], rng: RandomSource) -> C:
    return _argmin([least_load_key(c) for c in candidates], candidates, rng)


def _argmin(keys: Sequence[object], candidates: Sequence[C], rng: RandomSource) -> C:
    """The candidate with the lowest key; exact ties broken by one draw (none without a tie)."""
    best = min(keys)  # type: ignore[type-var]
    tied = [c for c, key in zip(candidates, keys) if key == best]
    return tied[_uniform_index(len(tied), rng)] if len(tied) > 1 else tied[0]


class DispatchPolicy:
    """One dispatch method and the state it keeps (only cache_aware keeps any)."""

    def __init__(
        self,
        method: DispatchMethod,
        rng: RandomSource,
        *,
        cache_aware: CacheAwareConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.method = DispatchMethod(method)
        self._rng = rng
        self.cache_aware: CacheAwarePolicy | None = None
        if self.method is DispatchMethod.CACHE_AWARE:
            self.cache_aware = CacheAwarePolicy(
                cache_aware or CacheAwareConfig(), least_load=lambda cs: _least_load(cs, self._rng),
                load_of=lambda w: (under_kv_pressure(w), outstanding_requests(w)), clock=clock)

    def pick(self, candidates: Sequence[C], hint: RouteHint = NO_HINT) -> Decision[C] | None:
        """Choose one of `candidates` (None if there are none) and record what the method keeps."""
        if self.cache_aware is not None:
            return self.cache_aware.pick(candidates, hint)
        picked = pick_worker(candidates, self.method, self._rng)
        return Decision(picked, Reason.LOAD) if picked is not None else None

    def retain(self, worker_names: Collection[str]) -> None:
        """Forget the state kept for workers not in `worker_names`."""
        if self.cache_aware is not None:
            self.cache_aware.retain(worker_names)
