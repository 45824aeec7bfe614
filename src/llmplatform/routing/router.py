"""The router: a table of workers, one dispatch policy over it, the load estimate, mark-downs.

Every routing decision in the platform is made here. A gateway routing locally holds one, filled
from the controller's `/list_workers` (openai_api/worker_routing.py); the controller holds one,
filled from its registry before each pick, for what it answers itself (`/get_worker_address` for
gateways that route through it, stock FastChat ones included, and its own stream proxy). Both rank
the same candidates the same way: same methods, same tie-breaking, same estimate of load between
heartbeats (load.py), so a gateway picks as the controller would.

The rules the table keeps, besides the policy's own state:

- **Candidates**: the listed workers serving the model, less those the caller excludes (a
  failover retry) and those marked down.
- **Mark-down**: a worker that failed a request (:meth:`Router.mark_down`) is skipped until an
  update asked for after the failure (:meth:`Router.update`'s ``requested_at``): an update asked
  for earlier cannot know of it, a later one lists the worker again only if it is still listed.
- **Staleness**: with ``max_age``, a table not updated for that long is dropped (every decision
  then returns None: the caller asks elsewhere) until the next update.
- **Load**: each pick counts as sent to its worker, and :meth:`Router.request_ended` takes an
  ended request off; both until a newer report (load.py).

Pure bookkeeping: no network, no asyncio; the clock and randomness are injected.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Sequence

from llmplatform.routing.cache_aware import NO_HINT, CacheAwareConfig, Decision, RouteHint
from llmplatform.routing.load import LoadEstimate, RoutedWorker
from llmplatform.routing.policies import DispatchMethod, DispatchPolicy, RandomSource

logger = logging.getLogger("llmplatform.routing")


class Router:
    """Workers, the policy that ranks them and what was seen since their reports."""

    def __init__(
        self,
        method: DispatchMethod | None = None,
        *,
        cache_aware: CacheAwareConfig | None = None,
        rng: RandomSource | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_age: float | None = None,
    ) -> None:
        if max_age is not None and not max_age > 0:
            raise ValueError(f"max_age must be > 0 seconds, got {max_age}")
        self.max_age = max_age
        self.clock = clock
        """The router's clock: when picks, ends, failures and reports happen."""
        self._rng: RandomSource = rng if rng is not None else random.Random()
        self.load = LoadEstimate(clock)
        self.policy: DispatchPolicy | None = None
        self._workers: list[RoutedWorker] = []
        self._updated_at: float | None = None
        self._down: dict[str, float] = {}
        """Workers that failed a request, and when."""
        if method is not None:
            self.configure(method, cache_aware)

    # ---- writes -------------------------------------------------------------------------------

    def configure(self, method: DispatchMethod, cache_aware: CacheAwareConfig | None = None) -> None:
        """Rank with `method`: the current policy (with what cache_aware learned) while the
        method stays, its knobs updated; a new one when the method changes."""
        method = DispatchMethod(method)
        policy = self.policy
        if policy is None or policy.method is not method:
            self.policy = DispatchPolicy(method, self._rng, cache_aware=cache_aware, clock=self.clock)
        elif policy.cache_aware is not None and cache_aware is not None:
            policy.cache_aware = policy.cache_aware.with_config(cache_aware)

    def update(self, workers: Sequence[RoutedWorker], *, requested_at: float) -> None:
        """Replace the table with `workers` (their reports as of a read asked for at
        `requested_at`); what is kept for workers no longer listed is forgotten."""
        assert self.policy is not None, "configure a method before updating"
        names = {w.worker_name for w in workers}
        self.policy.retain(names)
        self.load.retain(names)
        for worker in workers:
            self.load.reported(worker.worker_name, worker.reported_at)
        self._workers = list(workers)
        self._updated_at = self.clock()
        # A failure seen after this read was asked for is newer than what the read says.
        self._down = {name: at for name, at in self._down.items() if at >= requested_at}

    def clear(self) -> None:
        """Forget everything, the method included: no decision until configured and updated."""
        self.policy = None
        self._workers = []
        self._updated_at = None
        self._down = {}
        self.load.clear()

    def request_ended(self, worker_name: str) -> None:
        """A request this router's owner sent `worker_name` (picked here or elsewhere) ended:
        it comes off the worker's estimated load until a report that no longer counts it."""
        worker = self._listed(worker_name.rstrip("/"))
        if worker is not None:
            self.load.ended(worker)

    def mark_down(self, worker_name: str) -> None:
        """`worker_name` failed a request: skip it until an update asked for after now."""
        self._down[worker_name.rstrip("/")] = self.clock()

    # ---- reads --------------------------------------------------------------------------------

    @property
    def method(self) -> DispatchMethod | None:
        """The method ranked with (None: not configured, no decisions)."""
        return self.policy.method if self.policy is not None else None

    @property
    def usable(self) -> bool:
        """True while the router holds a table it may route from."""
        return self._updated_at is not None

    def workers(self) -> list[RoutedWorker]:
        """The listed workers as last updated (down ones included)."""
        return list(self._workers)

    def models(self) -> set[str]:
        """Every model a listed worker serves (down ones included)."""
        return {name for w in self._workers for name in w.model_names}

    def pick(self, model: str, exclude: Collection[str] = ()) -> str | None:
        """:meth:`decide` without a hint, the worker's name only."""
        decision = self.decide(model, exclude)
        return decision.worker.worker_name if decision is not None else None

    def decide(self, model: str, exclude: Collection[str] = (), hint: RouteHint = NO_HINT
               ) -> Decision[RoutedWorker] | None:
        """The worker for the next `model` request (ranked by its estimated load, `hint` matched
        under cache_aware), counted as sent to it; None when the table has no candidate (none
        listed, all excluded or down) or no fresh table."""
        if not self._fresh():
            return None
        assert self.policy is not None  # set before any update made the table fresh
        unusable = {name.rstrip("/") for name in exclude} | self._down.keys()
        candidates = [self.load.estimate(w) for w in self._workers
                      if model in w.model_names and w.worker_name not in unusable]
        decision = self.policy.pick(candidates, hint)
        if decision is not None:
            self.load.sent(decision.worker.worker_name)
        return decision

    def _listed(self, worker_name: str) -> RoutedWorker | None:
        return next((w for w in self._workers if w.worker_name == worker_name), None)

    def _fresh(self) -> bool:
        """Whether a table is held and young enough; an old one is dropped here."""
        if self._updated_at is None:
            return False
        age = self.clock() - self._updated_at
        if self.max_age is None or age <= self.max_age:
            return True
        logger.warning("no worker list for %.1f s; not routing from it until updated again", age)
        self.clear()
        return False
