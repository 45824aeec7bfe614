"""Choosing which worker serves the next request for a model.

`pick_worker` is a pure function over candidate snapshots; `Dispatcher` ties it to the registry
and records the pick. Randomness is injected (anything with `random() -> float`, e.g.
`random.Random(seed)`) so tests can pin exact outcomes.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Protocol

from llmplatform.controller.registry import WorkerInfo, WorkerRegistry


class DispatchMethod(str, enum.Enum):
    LOTTERY = "lottery"
    """Random, weighted by `speed`."""
    SHORTEST_QUEUE = "shortest_queue"
    """Argmin of `queue_length / speed`, ties broken at random (FastChat's default)."""


class RandomSource(Protocol):
    def random(self) -> float:
        """A float uniformly drawn from [0, 1)."""
        ...


def pick_worker(
    candidates: Sequence[WorkerInfo], method: DispatchMethod, rng: RandomSource
) -> WorkerInfo | None:
    """Pick one of `candidates` (None if there are none). Does not change any state."""
    if not candidates:
        return None
    if method is DispatchMethod.LOTTERY:
        return _lottery(candidates, rng)
    if method is DispatchMethod.SHORTEST_QUEUE:
        return _shortest_queue(candidates, rng)
    raise ValueError(f"unknown dispatch method {method!r}")


def _uniform_index(n: int, rng: RandomSource) -> int:
    # min() guards against a source that returns exactly 1.0.
    return min(int(rng.random() * n), n - 1)


def _lottery(candidates: Sequence[WorkerInfo], rng: RandomSource) -> WorkerInfo:
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


def _shortest_queue(candidates: Sequence[WorkerInfo], rng: RandomSource) -> WorkerInfo:
    """Lowest `queue_length / speed` wins; exact fractions so 1/2 and 2/4 tie.

    A speed-0 worker has an infinite normalized queue: chosen only if all are speed 0.
    """

    def load(c: WorkerInfo) -> Fraction | float:
        return Fraction(c.queue_length, c.speed) if c.speed > 0 else math.inf

    loads = [load(c) for c in candidates]
    best = min(loads)
    tied = [c for c, value in zip(candidates, loads) if value == best]
    return tied[_uniform_index(len(tied), rng)] if len(tied) > 1 else tied[0]


class Dispatcher:
    """Chooses a live worker for a model and records the choice in the registry."""

    def __init__(
        self,
        registry: WorkerRegistry,
        method: DispatchMethod = DispatchMethod.SHORTEST_QUEUE,
        rng: RandomSource | None = None,
    ) -> None:
        self.registry = registry
        self.method = DispatchMethod(method)
        self._rng: RandomSource = rng if rng is not None else random.Random()

    def choose(self, model: str) -> WorkerInfo | None:
        """The worker to send the next `model` request to, or None if no live worker has it.

        With shortest_queue the chosen worker's recorded queue grows by one (as FastChat does),
        so a burst between two heartbeats spreads across workers instead of piling onto the
        one that looked idlest at the last heartbeat.
        """
        picked = pick_worker(self.registry.workers_for(model), self.method, self._rng)
        if picked is not None and self.method is DispatchMethod.SHORTEST_QUEUE:
            self.registry.increment_queue(picked.worker_name)
        return picked
