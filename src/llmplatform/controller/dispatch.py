"""The controller's router: the registry's live workers, ranked by routing's `Router`.

The controller answers `/get_worker_address` (for gateways that route through it, stock FastChat
ones included) and proxies `/worker_generate_stream`; both pick here, with the same code a
gateway routing locally runs over the controller's `/list_workers` (llmplatform.routing). Before
each pick the router's table is replaced by the registry's live workers as they are now (each
with its last report), so liveness, reports and registrations are the registry's alone; the
router keeps the policy's state and the picks since each worker's report (its load estimate),
whose count `/list_workers` lists as `num_dispatched`.
"""

from __future__ import annotations

import random
from collections.abc import Collection

from llmplatform.controller.registry import WorkerInfo, WorkerRegistry
from llmplatform.routing.cache_aware import NO_HINT, CacheAwareConfig, Decision, RouteHint
from llmplatform.routing.load import RoutedWorker
from llmplatform.routing.policies import DEFAULT_DISPATCH_METHOD, DispatchMethod, DispatchPolicy, RandomSource
from llmplatform.routing.router import Router


def routed(info: WorkerInfo) -> RoutedWorker:
    """A registry entry as routing sees it."""
    return RoutedWorker(
        worker_name=info.worker_name, model_names=frozenset(info.model_names), speed=info.speed,
        queue_length=info.queue_length, num_running=info.num_running,
        num_waiting=info.num_waiting, kv_cache_usage=info.kv_cache_usage,
        max_num_running=info.max_num_running, reported_at=info.last_heartbeat,
        cache_epoch=info.cache_epoch, prefix_cache_queries=info.prefix_cache_queries)


class Dispatcher:
    """Chooses a live worker for a model (routing's `Router` over the registry)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        method: DispatchMethod = DEFAULT_DISPATCH_METHOD,
        rng: RandomSource | None = None,
        *,
        cache_aware: CacheAwareConfig | None = None,
    ) -> None:
        self.registry = registry
        self.method = DispatchMethod(method)
        # The registry's clock: a pick and a heartbeat are compared by it (routing/load.py).
        clock = self._clock = registry.clock
        self.router = Router(self.method, cache_aware=cache_aware,
                             rng=rng if rng is not None else random.Random(), clock=clock)

    @property
    def policy(self) -> DispatchPolicy:
        assert self.router.policy is not None  # configured at construction, never cleared
        return self.router.policy

    def choose(self, model: str, exclude: Collection[str] = ()) -> RoutedWorker | None:
        decision = self.decide(model, exclude)
        return decision.worker if decision is not None else None

    def decide(self, model: str, exclude: Collection[str] = (), hint: RouteHint = NO_HINT
               ) -> Decision[RoutedWorker] | None:
        """The worker to send the next `model` request to, or None if no live worker has it.

        Workers named in `exclude` are not candidates: a gateway retrying a request that one
        worker failed asks for a different one. Every pick counts as load on its worker until
        the worker's next report (routing/load.py), so a burst between two heartbeats spreads
        across workers instead of piling onto the one that looked idlest at the last heartbeat.
        """
        self.sync()
        return self.router.decide(model, exclude, hint)

    def dispatched(self) -> dict[str, int]:
        """Per live worker, the requests picked for it since its last report."""
        self.sync()
        return {w.worker_name: self.router.load.net_sent(w.worker_name) for w in self.router.workers()}

    def sync(self) -> None:
        """The router's table := the registry's live workers, as they are now."""
        self.router.update([routed(w) for w in self.registry.live_workers()],
                           requested_at=self._clock())
