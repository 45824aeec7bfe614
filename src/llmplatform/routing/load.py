"""The one load estimate: how busy a worker is now, from its last report and what was seen since.

A worker reports its load (running, waiting, KV-cache use) with each heartbeat, every few
seconds. Between two reports a router knows more than the report: the requests it sent the worker
since (a burst between two heartbeats otherwise sees the same stale numbers and piles onto the
worker that looked idlest) and, where it sees them end (a gateway does, the stream closes there),
the requests that finished since. :class:`LoadEstimate` keeps both, per worker, and
:meth:`LoadEstimate.estimate` is the report with them applied: the controller and every gateway
rank workers by this same estimate (router.py holds one per router).

What each router sees differs, not how it counts: the controller sees its own picks (and lists
their count as a worker's ``num_dispatched``); a gateway sees its picks and their ends, and starts
from the controller's count (its ``RoutedWorker.num_dispatched``), which its own picks cannot
show. A newer report drops the events at or before it: the report includes them. Requests that
ended past what was sent since come off the reported queue (waiting first): without that, a
worker whose requests finish within a heartbeat (short answers, prompts found in its prefix cache)
keeps looking as busy as at its last report plus every pick since, and bursts alternate between
the workers (on benchmarks/routing.py's skewed load whole rounds of 8 requests went to one worker
while the other, just as idle, looked full).

Pure bookkeeping: the clock is injected, nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

KV_CACHE_PRESSURE = 0.9
"""KV-cache usage from which a worker is avoided: near full, the scheduler must preempt running
sequences (recomputing them later) or leave new ones waiting."""
MAX_EVENTS_TRACKED = 4096
"""Requests sent (and ended) remembered per worker. A worker that never heartbeats
(`check_heart_beat` false) never has them dropped; past this the counts saturate."""


class DispatchCandidate(Protocol):
    """The facts dispatch ranks a worker by (read-only: a pick never changes a candidate)."""

    @property
    def speed(self) -> int: ...
    @property
    def queue_length(self) -> int: ...
    @property
    def num_running(self) -> int | None: ...
    @property
    def num_waiting(self) -> int | None: ...
    @property
    def kv_cache_usage(self) -> float | None: ...
    @property
    def max_num_running(self) -> int | None: ...
    @property
    def num_dispatched(self) -> int:
        """Requests sent to the worker since its last report (the report cannot show them)."""
        ...


@dataclass(frozen=True)
class RoutedWorker:
    """One worker as routing sees it: who it is, what it serves, its last load report."""

    worker_name: str
    model_names: frozenset[str]
    speed: int
    queue_length: int
    num_running: int | None
    num_waiting: int | None
    kv_cache_usage: float | None
    max_num_running: int | None
    reported_at: float
    """When its last report (heartbeat, registration) arrived, on the router's clock."""
    num_dispatched: int = 0
    """Requests sent to it since that report that this router did not send (a gateway: the
    controller's picks); the estimate adds the router's own."""
    cache_epoch: str | None = None
    """Changes when the worker's prefix cache is known to be gone (cache_aware forgets it)."""
    prefix_cache_queries: int | None = None
    """None: the worker reports no prefix cache (cache_aware ranks it by load alone)."""


def outstanding_requests(worker: DispatchCandidate) -> int:
    """Requests the worker has running or waiting, as last reported, plus those sent since."""
    if worker.num_running is not None and worker.num_waiting is not None:
        reported = worker.num_running + worker.num_waiting
    else:
        reported = worker.queue_length
    return reported + worker.num_dispatched


def under_kv_pressure(worker: DispatchCandidate) -> bool:
    return worker.kv_cache_usage is not None and worker.kv_cache_usage >= KV_CACHE_PRESSURE


class LoadEstimate:
    """Per worker, the requests sent and ended since its last report, oldest first."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._reported_at: dict[str, float] = {}
        self._sent: dict[str, deque[float]] = {}
        self._ended: dict[str, deque[float]] = {}

    def reported(self, worker_name: str, at: float) -> None:
        """`worker_name`'s report taken at `at` is known: a newer one than the last known drops
        the events at or before it (it counts them); the same report again changes nothing."""
        last = self._reported_at.get(worker_name)
        if last is not None and at <= last:
            return
        self._reported_at[worker_name] = at
        for events in (self._sent.get(worker_name), self._ended.get(worker_name)):
            while events and events[0] <= at:
                events.popleft()

    def sent(self, worker_name: str) -> None:
        """A request was sent to `worker_name` now."""
        self._events(self._sent, worker_name).append(self._clock())

    def ended(self, worker: RoutedWorker) -> None:
        """A request this router sent `worker` ended now. An end with nothing left to take off
        (a request with several streams, one pick) is not kept as credit against later picks."""
        if outstanding_requests(self.estimate(worker)) > 0:
            self._events(self._ended, worker.worker_name).append(self._clock())

    def net_sent(self, worker_name: str) -> int:
        """Requests sent to `worker_name` since its report less those that ended since."""
        return len(self._sent.get(worker_name, ())) - len(self._ended.get(worker_name, ()))

    def estimate(self, worker: RoutedWorker) -> RoutedWorker:
        """`worker` as dispatch should see it now: its report, plus the requests sent it since
        (by others: `num_dispatched`; by this router), less this router's that ended since.
        More ended than were sent since: they come off the reported queue (waiting first)."""
        net = self.net_sent(worker.worker_name)
        if net >= 0:
            return dataclasses.replace(worker, num_dispatched=worker.num_dispatched + net)
        gone = -net
        dispatched = max(worker.num_dispatched - gone, 0)
        gone -= worker.num_dispatched - dispatched
        waiting, running = worker.num_waiting, worker.num_running
        if waiting is not None and running is not None:
            off_waiting = min(waiting, gone)
            waiting, running = waiting - off_waiting, max(running - (gone - off_waiting), 0)
        return dataclasses.replace(worker, num_dispatched=dispatched, num_waiting=waiting,
                                   num_running=running, queue_length=max(worker.queue_length - gone, 0))

    def retain(self, worker_names: Collection[str]) -> None:
        """Forget every worker not in `worker_names`."""
        for table in (self._reported_at, self._sent, self._ended):
            for name in [n for n in table if n not in worker_names]:
                del table[name]

    def clear(self) -> None:
        self.retain(())

    @staticmethod
    def _events(table: dict[str, deque[float]], worker_name: str) -> deque[float]:
        events = table.get(worker_name)
        if events is None:
            events = table[worker_name] = deque(maxlen=MAX_EVENTS_TRACKED)
        return events
