"""The controller's registry: which worker serves which models, how loaded, and whether alive.

Pure bookkeeping (no FastAPI, no asyncio, no network) so it can be tested with exact
expectations: time comes from an injected clock.

Liveness has one definition, used everywhere: a worker that checks heartbeats is live while
`now - last_heartbeat <= heartbeat_expiration`; a worker registered with
`check_heart_beat=False` is live until removed. Queries (`list_models`, `workers_for`,
`aggregate_status`) see only live workers even before `expire` sweeps the stale ones out, so
a dead worker disappears from answers as soon as it is stale, not one sweep period later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmplatform.protocol.controller import WorkerStatus
from llmplatform.protocol.lora import LoRAAdapterCard

DEFAULT_HEARTBEAT_EXPIRATION_S = 10.0


@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one registered worker. Frozen: the registry replaces, never mutates."""

    worker_name: str
    model_names: tuple[str, ...]
    speed: int
    queue_length: int
    check_heart_beat: bool
    multimodal: bool
    last_heartbeat: float
    """Clock reading of the last registration or heartbeat, in seconds."""
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    max_num_running: int | None = None
    """Batch capacity reported at registration (ours only); heartbeats leave it alone."""
    backend: str | None = None
    """The worker's inference backend, reported at registration (ours only)."""
    tasks: tuple[str, ...] | None = None
    """What its model serves ("generate", "embed"), reported at registration (ours only)."""
    lora_adapters: tuple[LoRAAdapterCard, ...] | None = None
    """The LoRA adapters among its model names, with their base model and path (ours only)."""
    instance_id: str | None = None
    """The worker process's random id (ours only; None for stock FastChat workers): tells a
    worker re-registering apart from a second worker announcing the same URL."""
    prefix_cache_queries: int | None = None
    """Prompt tokens the worker looked up in its prefix cache, cumulative (ours, paged only)."""
    prefix_cache_hits: int | None = None
    """...and how many of them it found cached."""
    prefix_cache_resets: int | None = None
    """Times the worker's prefix cache was emptied (reset route, engine rebuilt), cumulative."""
    generation: int = 0
    """Which registration this entry belongs to (a counter over the registry's lifetime): kept
    by heartbeats and status updates, new on every `register`. A status poll started before a
    deregistration or a re-registration carries the old generation and so cannot write over
    (or bring back) what happened meanwhile."""

    @property
    def cache_epoch(self) -> str | None:
        """Changes whenever the worker's prefix cache is known to be gone: another process at
        this address, or a reset it reported. A digest of the instance id, so it can be listed
        (the id itself is what the worker's heartbeats are told apart by)."""
        if self.instance_id is None and self.prefix_cache_resets is None:
            return None
        instance = hashlib.sha256((self.instance_id or "").encode()).hexdigest()[:16]
        return f"{instance}:{self.prefix_cache_resets or 0}"


class WorkerRegistry:
    """Registered workers keyed by `worker_name` (the worker's base URL)."""

    def __init__(
        self,
        heartbeat_expiration: float = DEFAULT_HEARTBEAT_EXPIRATION_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if heartbeat_expiration <= 0:
            raise ValueError(f"heartbeat_expiration must be > 0 s, got {heartbeat_expiration}")
        self.heartbeat_expiration = heartbeat_expiration
        self.clock = clock
        """The registry's clock: heartbeats are stamped with it (routing compares picks to them)."""
        self._workers: dict[str, WorkerInfo] = {}
        self._generations = itertools.count(1)
        self._draining: set[str] = set()
        """Workers being stopped (the lifecycle API): never offered again, even while they are
        registered and beating, so new requests go elsewhere while theirs finish."""

    # ---- writes -------------------------------------------------------------------------------

    def register(
        self,
        worker_name: str,
        status: WorkerStatus,
        *,
        check_heart_beat: bool = True,
        multimodal: bool = False,
        instance_id: str | None = None,
    ) -> WorkerInfo | None:
        """Add or replace a worker; return the entry it replaced (None if new).

        Replacing is the normal path for a worker that restarted or was told `exist: false`;
        the caller decides whether a replacement looks like two workers sharing one URL.
        """
        previous = self._workers.get(worker_name)
        self._workers[worker_name] = WorkerInfo(
            worker_name=worker_name,
            model_names=tuple(status.model_names),
            speed=status.speed,
            queue_length=status.queue_length,
            check_heart_beat=check_heart_beat,
            multimodal=multimodal,
            last_heartbeat=self.clock(),
            num_running=status.num_running,
            num_waiting=status.num_waiting,
            kv_cache_usage=status.kv_cache_usage,
            max_num_running=status.max_num_running,
            backend=status.backend,
            tasks=tuple(status.tasks) if status.tasks is not None else None,
            lora_adapters=None if status.lora_adapters is None else tuple(status.lora_adapters),
            prefix_cache_queries=status.prefix_cache_queries,
            prefix_cache_hits=status.prefix_cache_hits,
            prefix_cache_resets=status.prefix_cache_resets,
            instance_id=instance_id,
            generation=next(self._generations),
        )
        return previous

    def update_status(self, worker_name: str, status: WorkerStatus, generation: int) -> bool:
        """Take a polled status as the worker's news (a beat, new load facts and model names),
        but only while `generation` is still the registration that was polled; False otherwise
        (removed or replaced meanwhile: the poll is no longer news, and must not bring it back).
        """
        info = self._workers.get(worker_name)
        if info is None or info.generation != generation:
            return False
        self._workers[worker_name] = dataclasses.replace(
            info,
            model_names=tuple(status.model_names),
            speed=status.speed,
            queue_length=status.queue_length,
            last_heartbeat=self.clock(),
            num_running=status.num_running,
            num_waiting=status.num_waiting,
            kv_cache_usage=status.kv_cache_usage,
            max_num_running=status.max_num_running or info.max_num_running,
            backend=status.backend or info.backend,
            tasks=tuple(status.tasks) if status.tasks is not None else info.tasks,
            lora_adapters=(info.lora_adapters if status.lora_adapters is None
                           else tuple(status.lora_adapters)),
            prefix_cache_queries=status.prefix_cache_queries,
            prefix_cache_hits=status.prefix_cache_hits,
            prefix_cache_resets=status.prefix_cache_resets,
        )
        return True

    def heartbeat(
        self,
        worker_name: str,
        queue_length: int,
        *,
        num_running: int | None = None,
        num_waiting: int | None = None,
        kv_cache_usage: float | None = None,
        prefix_cache_queries: int | None = None,
        prefix_cache_hits: int | None = None,
        prefix_cache_resets: int | None = None,
    ) -> bool:
        """Record a heartbeat; False means "unknown, register again".

        A stale entry not yet swept also answers False (and is dropped), so a worker that
        vanished from `list_models` re-registers instead of silently reappearing.
        Load facts are replaced, not merged: an absent fact becomes None, never a stale value.
        """
        info = self._workers.get(worker_name)
        if info is None:
            return False
        now = self.clock()
        if not self._is_live(info, now):
            del self._workers[worker_name]
            self._draining.discard(worker_name)
            return False
        self._workers[worker_name] = dataclasses.replace(
            info,
            queue_length=queue_length,
            last_heartbeat=now,
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=kv_cache_usage,
            prefix_cache_queries=prefix_cache_queries,
            prefix_cache_hits=prefix_cache_hits,
            prefix_cache_resets=prefix_cache_resets,
        )
        return True

    def set_draining(self, worker_name: str) -> None:
        """Route nothing more to `worker_name` (it is being stopped); it leaves the listings at
        once. Forgotten when the worker is removed, so a new worker at the address is routed."""
        self._draining.add(worker_name)

    def remove(self, worker_name: str, generation: int | None = None) -> bool:
        """Forget a worker; False if it was not registered (or, with `generation`, if its entry
        is now another registration's)."""
        info = self._workers.get(worker_name)
        if info is None or (generation is not None and info.generation != generation):
            return False
        del self._workers[worker_name]
        self._draining.discard(worker_name)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Remove workers whose last heartbeat is older than `heartbeat_expiration`.

        Exactly `heartbeat_expiration` seconds old is still live. Returns the removed names,
        sorted, so the caller can log them.
        """
        now = self.clock() if now is None else now
        stale = sorted(name for name, info in self._workers.items() if not self._is_live(info, now))
        for name in stale:
            del self._workers[name]
            self._draining.discard(name)
        return stale

    # ---- reads (live workers only) ------------------------------------------------------------

    def get(self, worker_name: str) -> WorkerInfo | None:
        """The entry for `worker_name`, live or not yet swept; None if unknown."""
        return self._workers.get(worker_name)

    def is_live(self, worker_name: str) -> bool:
        info = self._workers.get(worker_name)
        return info is not None and self._is_live(info, self.clock())

    def live_workers(self) -> list[WorkerInfo]:
        """Live workers sorted by name, so dispatch sees candidates in a stable order."""
        now = self.clock()
        return [
            info for name, info in sorted(self._workers.items())
            if self._is_live(info, now) and name not in self._draining
        ]

    def quiet_workers(self, min_silence: float) -> list[WorkerInfo]:
        """Live heartbeat-checked workers not heard from for more than `min_silence` seconds."""
        now = self.clock()
        return [
            info
            for info in self.live_workers()
            if info.check_heart_beat and now - info.last_heartbeat > min_silence
        ]

    def list_models(self, *, multimodal: bool | None = None) -> list[str]:
        """Sorted union of model names over live workers.

        multimodal=None: every worker; False: language-only workers; True: multimodal ones.
        """
        names: set[str] = set()
        for info in self.live_workers():
            if multimodal is None or info.multimodal == multimodal:
                names.update(info.model_names)
        return sorted(names)

    def workers_for(self, model: str) -> list[WorkerInfo]:
        """Live workers serving `model`, sorted by name."""
        return [info for info in self.live_workers() if model in info.model_names]

    def aggregate_status(self, dispatched: Mapping[str, int] | None = None) -> WorkerStatus:
        """This controller seen as one big worker, so it can register with a parent controller.

        Counts are summed (a queue counts the requests `dispatched` to it since its heartbeat);
        a load fact is summed over the workers that report it and stays None when none does
        (stock FastChat workers).
        """
        workers = self.live_workers()
        names: set[str] = set()
        for info in workers:
            names.update(info.model_names)
        running = [w.num_running for w in workers if w.num_running is not None]
        waiting = [w.num_waiting for w in workers if w.num_waiting is not None]
        capacity = [w.max_num_running for w in workers if w.max_num_running is not None]
        return WorkerStatus(
            model_names=sorted(names),
            speed=sum(w.speed for w in workers),
            queue_length=sum(w.queue_length + (dispatched or {}).get(w.worker_name, 0) for w in workers),
            num_running=sum(running) if running else None,
            num_waiting=sum(waiting) if waiting else None,
            max_num_running=sum(capacity) if capacity else None,
        )

    def __contains__(self, worker_name: object) -> bool:
        """Membership, stale-but-unswept entries included (what `expire` has not removed)."""
        return worker_name in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    # ---- internals ----------------------------------------------------------------------------

    def _is_live(self, info: WorkerInfo, now: float) -> bool:
        if not info.check_heart_beat:
            return True
        return now - info.last_heartbeat <= self.heartbeat_expiration
