"""The gateway's routing table: which worker serves the next request, without asking the controller.

FastChat's gateway asks the controller (`POST /get_worker_address`) before every request: one
more round trip on every request's path. With `--routing local` (the default) a background task
reads the controller's live workers (`GET /list_workers`, ours: every load fact dispatch ranks by,
and the controller's dispatch method) every `--worker-refresh-interval` seconds, and a request
picks from that table with the controller's own policy (:class:`~llmplatform.controller.dispatch.DispatchPolicy`).

What the table cannot answer, the controller is asked, exactly as before (`pick` returns None):

- a model no usable listed worker serves: a worker registered since the last read (usable at
  once), an unknown model (the controller's answer keeps today's 404 and 503), or every listed
  worker excluded by this request's failover or marked down;
- no table at all: not read yet; a controller without `/list_workers` (stock FastChat: 404/405,
  asked again every `RECHECK_UNSUPPORTED_S`); a dispatch method this gateway does not know; or a
  table older than `max_age` because the controller stopped answering (the per-request calls
  then give today's clean 503s).

Load between reads. A worker's load facts change only with its heartbeat. Like the controller,
which counts its picks since each worker's last heartbeat (`num_dispatched`), the table adds its
own picks since the worker's last heartbeat (and the controller's count) to the reported load,
so a burst spreads out instead of piling onto the worker that looked idlest. Unlike the
controller, the gateway also sees its requests end (`request_ended`): each one that ended since
the heartbeat comes off the estimate. Without that, a worker whose requests finish within a
heartbeat (short answers, prompts found in its prefix cache) keeps looking as busy as at its
last report plus every pick since, and bursts alternate between the workers: on
benchmarks/routing.py's skewed load whole rounds of 8 requests went to one worker while the
other, just as idle, looked full. A read that brings a newer heartbeat drops the picks and ends
before that heartbeat (the report includes them); a read that brings none keeps them (resetting
on every read would forget them while the worker's report still cannot show them: reads are ~3x
as frequent as heartbeats by default).

cache_aware. When the controller's method is cache_aware, the table runs the same policy
(:class:`~llmplatform.controller.dispatch.DispatchPolicy`, with the knobs the listing carries)
over the request's :class:`RouteHint`: its own prefix trees, built from its own picks (a request
it hands to the controller is matched there, against the controller's). The hint is computed
here for both paths (:func:`route_hint`): the routing text is the completion prompt, or the chat
messages serialized one after another, which extends as a conversation does (the worker's chat
template renders them in the same order), so a conversation's next turn matches its last.

Failures. A worker that could not take a request (`may_try_another_worker`: refused, reset, 503,
429) is marked down until the next read that started after the failure: later picks skip it
meanwhile, and the read after that lists it again only if the controller still does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import json
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmplatform.controller.cache_aware import (
    CHUNK_CHARS,
    MAX_ROUTE_CHUNKS,
    NO_HINT,
    CacheAwareConfig,
    Decision,
    RouteHint,
)
from llmplatform.controller.dispatch import DispatchMethod, DispatchPolicy, RandomSource, outstanding_requests
from llmplatform.errors import LLMPlatformError
from llmplatform.protocol.controller import CacheAwareOptions, ListWorkersResponse, WorkerDescription

logger = logging.getLogger("llmplatform.openai_api.worker_routing")

STALE_AFTER_REFRESHES = 10
"""A table not refreshed for this many intervals (the controller is down or silent) is dropped."""
MIN_STALE_AFTER_S = 5.0
"""...but never sooner than this: a short interval must not make a controller hiccup fatal."""
RECHECK_UNSUPPORTED_S = 60.0
"""How often a controller that cannot drive local routing (no `/list_workers`, or an unknown
dispatch method) is asked again, in case it was upgraded."""
MAX_PICKS_TRACKED = 4096
"""Own picks (and requests ended) remembered per worker. A worker that never heartbeats
(`check_heart_beat` false) never has them dropped; past this the counts saturate."""


def max_table_age(refresh_interval: float) -> float:
    """Seconds a table may go without a successful read before it is dropped."""
    return max(STALE_AFTER_REFRESHES * refresh_interval, MIN_STALE_AFTER_S)


class RouteSource(str, enum.Enum):
    """Where a request's worker came from (the gateway's routing-decision metric)."""

    TABLE = "table"
    CONTROLLER = "controller"


@dataclass(frozen=True)
class RoutedWorker:
    """One listed worker as dispatch sees it (a `DispatchCandidate`)."""

    worker_name: str
    model_names: frozenset[str]
    speed: int
    queue_length: int
    num_running: int | None
    num_waiting: int | None
    kv_cache_usage: float | None
    max_num_running: int | None
    num_dispatched: int
    """The controller's picks since the worker's last heartbeat (plus, in a pick's candidate
    list, the table's own)."""
    heartbeat_at: float
    """When the worker's last heartbeat arrived, on the gateway's clock."""
    cache_epoch: str | None = None
    """Changes when the worker's prefix cache is known to be gone (cache_aware forgets it)."""
    prefix_cache_queries: int | None = None
    """None: the worker reports no prefix cache (cache_aware ranks it by load alone)."""

    @classmethod
    def from_description(cls, worker: WorkerDescription, now: float) -> RoutedWorker:
        return cls(
            worker_name=worker.worker_name.rstrip("/"),
            model_names=frozenset(worker.model_names),
            speed=worker.speed,
            queue_length=worker.queue_length,
            num_running=worker.num_running,
            num_waiting=worker.num_waiting,
            kv_cache_usage=worker.kv_cache_usage,
            max_num_running=worker.max_num_running,
            num_dispatched=worker.num_dispatched,
            heartbeat_at=now - worker.last_heartbeat_age_s,
            cache_epoch=worker.cache_epoch,
            prefix_cache_queries=worker.prefix_cache_queries,
        )


class RoutingTable:
    """The last live-worker list read from the controller, and the picks made from it since.

    Pure bookkeeping (no network, no asyncio); time and randomness are injected, as in the
    controller's registry and dispatcher, so tests can pin exact outcomes.
    """

    def __init__(
        self,
        *,
        max_age: float,
        clock: Callable[[], float] = time.monotonic,
        rng: RandomSource | None = None,
    ) -> None:
        if not max_age > 0:
            raise ValueError(f"max_age must be > 0 seconds, got {max_age}")
        self.max_age = max_age
        self._clock = clock
        self._rng: RandomSource = rng if rng is not None else random.Random()
        self._method: DispatchMethod | None = None
        self._policy: DispatchPolicy | None = None
        self._workers: list[RoutedWorker] = []
        self._refreshed_at: float | None = None
        self._picks: dict[str, deque[float]] = {}
        """Per worker, when the table picked it, oldest first (the clock only moves forward)."""
        self._ended: dict[str, deque[float]] = {}
        """Per worker, when a request this gateway sent it ended, oldest first."""
        self._down: dict[str, float] = {}
        """Workers that failed a request, and when."""

    # ---- writes -------------------------------------------------------------------------------

    def update(self, listing: ListWorkersResponse, *, requested_at: float) -> None:
        """Replace the table with a fresh read, asked for at `requested_at`.

        A listing without a dispatch method this gateway knows cannot drive local routing:
        the table is cleared, and `usable` says so.
        """
        now = self._clock()
        try:
            method = DispatchMethod(listing.dispatch_method) if listing.dispatch_method else None
        except ValueError:
            method = None
        if method is None:  # the refresher asks again only every RECHECK_UNSUPPORTED_S
            logger.warning("the controller's dispatch method %r is unknown here; routing "
                           "through the controller per request", listing.dispatch_method)
            self.clear()
            return
        workers = [RoutedWorker.from_description(w, now) for w in listing.workers]
        self._policy = self._policy_for(method, listing.cache_aware)
        self._policy.retain({w.worker_name for w in workers})
        self._method = method
        self._workers = workers
        self._refreshed_at = now
        self._picks = {w.worker_name: _after(self._picks.get(w.worker_name), w.heartbeat_at)
                       for w in workers}
        self._ended = {w.worker_name: _after(self._ended.get(w.worker_name), w.heartbeat_at)
                       for w in workers}
        # A failure seen after this read was asked for is newer than what the read says.
        self._down = {name: at for name, at in self._down.items() if at >= requested_at}

    def _policy_for(self, method: DispatchMethod, options: CacheAwareOptions | None) -> DispatchPolicy:
        """The policy to rank with: the current one (with what cache_aware learned) while the
        controller's method stays, its knobs updated; a new one when the method changes."""
        config = CacheAwareConfig(**options.model_dump(exclude_none=True)) if options is not None else None
        policy = self._policy
        if policy is None or policy.method is not method:
            return DispatchPolicy(method, self._rng, cache_aware=config, clock=self._clock)
        if policy.cache_aware is not None and config is not None:
            policy.cache_aware = policy.cache_aware.with_config(config)
        return policy

    def clear(self) -> None:
        """Forget everything: until the next good read, every request asks the controller."""
        self._method = None
        self._policy = None
        self._workers = []
        self._refreshed_at = None
        self._picks = {}
        self._ended = {}
        self._down = {}

    def request_ended(self, worker_name: str) -> None:
        """A request this gateway sent `worker_name` (picked here or by the controller) ended:
        it comes off the worker's estimated load until a heartbeat that no longer counts it."""
        name = worker_name.rstrip("/")
        worker = next((w for w in self._workers if w.worker_name == name), None)
        # An end with nothing left to take off (a request with several streams, one pick) is
        # not kept as credit against the next picks.
        if worker is not None and outstanding_requests(self._estimated(worker)) > 0:
            self._ended[name].append(self._clock())

    def mark_down(self, worker_name: str) -> None:
        """`worker_name` failed a request: skip it until a read that started after now."""
        self._down[worker_name.rstrip("/")] = self._clock()

    # ---- reads --------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """True while the table holds a read the gateway may route from."""
        return self._refreshed_at is not None

    def workers(self) -> list[RoutedWorker]:
        """The listed workers as last read (down ones included), sorted by name."""
        return list(self._workers)

    def models(self) -> set[str]:
        """Every model a listed worker serves (down ones included)."""
        return {name for w in self._workers for name in w.model_names}

    def pick(self, model: str, exclude: Collection[str] = ()) -> str | None:
        """A worker for the next `model` request, ranked as the controller would rank it, and
        counted as dispatched to it; None when the table cannot say (ask the controller)."""
        decision = self.decide(model, exclude)
        return decision.worker.worker_name if decision is not None else None

    def decide(self, model: str, exclude: Collection[str] = (), route: RouteRequest | None = None
               ) -> Decision[RoutedWorker] | None:
        """:meth:`pick`, with what the request offers routing (for cache_aware) and the reason."""
        if not self._fresh():
            return None
        unusable = {name.rstrip("/") for name in exclude} | self._down.keys()
        candidates = [self._estimated(w) for w in self._workers
                      if model in w.model_names and w.worker_name not in unusable]
        assert self._policy is not None  # set with every read that made the table fresh
        hint = route.hint if route is not None and self._policy.cache_aware is not None else NO_HINT
        decision = self._policy.pick(candidates, hint)
        if decision is None:
            return None
        self._picks[decision.worker.worker_name].append(self._clock())
        return decision

    def _estimated(self, worker: RoutedWorker) -> RoutedWorker:
        """`worker` as dispatch should see it now: its report, plus the requests sent it since
        (the controller's and this table's picks), less those of this gateway's that ended
        since. More ended than were sent since: they come off the reported queue (waiting
        first)."""
        net = len(self._picks[worker.worker_name]) - len(self._ended[worker.worker_name])
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

    @property
    def method(self) -> DispatchMethod | None:
        """The controller's dispatch method as last read (None: no usable table)."""
        return self._method

    def _fresh(self) -> bool:
        """Whether a read is held and young enough; an old one is dropped here."""
        if self._refreshed_at is None:
            return False
        age = self._clock() - self._refreshed_at
        if age <= self.max_age:
            return True
        logger.warning("no worker list from the controller for %.1f s; routing through the "
                       "controller per request until it answers again", age)
        self.clear()
        return False


def _after(times: deque[float] | None, heartbeat_at: float) -> deque[float]:
    """`times` after `heartbeat_at` (events a worker's report could not count yet)."""
    kept = times if times is not None else deque(maxlen=MAX_PICKS_TRACKED)
    while kept and kept[0] <= heartbeat_at:
        kept.popleft()
    return kept


def chat_routing_text(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
    """What a chat request is matched by: its tools (any JSON value, as the client sent them),
    then each message as compact JSON, one per line. Prefix-preserving: a conversation's next
    turn starts with its previous turn's text."""
    lines = [json.dumps(tools, sort_keys=True, separators=(",", ":"), default=str)] if tools else []
    length = sum(map(len, lines))
    for message in messages:
        if length > MAX_ROUTE_CHUNKS * CHUNK_CHARS:  # the rest would not be matched anyway
            break
        lines.append(json.dumps(dict(message), sort_keys=True, separators=(",", ":"), default=str))
        length += len(lines[-1]) + 1
    return "\n".join(lines) + "\n"


def completion_routing_text(prompt: str | Sequence[int]) -> str:
    """What a completion is matched by: its prompt (token ids written out)."""
    return prompt if isinstance(prompt, str) else ",".join(map(str, prompt)) + ","


@dataclass(frozen=True)
class RouteRequest:
    """What a request offers routing: its routing text, session key and the cache salt it is
    sent with (its prefix trees and sessions are the salt's own, as its KV blocks are). The
    hint (hashing the text) is computed only when a policy asks for it."""

    text: str
    session_key: str | None = None
    cache_salt: str | None = None

    @functools.cached_property
    def hint(self) -> RouteHint:
        return RouteHint.of(self.text, self.session_key, self.cache_salt)


def session_key(headers: Mapping[str, str], header_name: str | None, user: str | None) -> str | None:
    """A request's session key for cache_aware stickiness: the `--session-header` header when
    set and sent, else OpenAI's `user` field; None without either."""
    if header_name:
        value = headers.get(header_name)
        if value:
            return f"header:{value}"
    return f"user:{user}" if user else None


ListWorkers = Callable[[], Awaitable[ListWorkersResponse | None]]
"""Reads the controller's `GET /list_workers`; None when the controller has no such route."""


class TableRefresher:
    """Keeps a :class:`RoutingTable` filled from the controller, in the background.

    `run` loops until cancelled (the gateway's lifespan does, at shutdown); a failed read is
    logged and the table kept (it ages out by itself), so nothing but cancellation stops it.
    """

    def __init__(
        self,
        table: RoutingTable,
        list_workers: ListWorkers,
        *,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.table = table
        self.interval = interval
        self._list_workers = list_workers
        self._clock = clock
        self._failing = False
        self._unsupported = False

    async def run(self) -> None:
        while True:
            try:
                delay = await self.refresh()
            except Exception:  # a bug must not end routing: log it, go on from the last table
                logger.exception("refreshing the routing table failed")
                delay = self.interval
            await asyncio.sleep(delay)

    async def refresh(self) -> float:
        """One read into the table; returns the seconds to wait before the next."""
        requested_at = self._clock()
        try:
            listing = await self._list_workers()
        except LLMPlatformError as exc:
            self._note_failure(exc)
            return self.interval
        if self._failing:
            logger.info("the controller lists workers again")
            self._failing = False
        if listing is None:
            if not self._unsupported:
                logger.info("the controller has no GET /list_workers (a stock FastChat "
                            "controller?): asking it for a worker on every request")
                self._unsupported = True
            self.table.clear()
            return RECHECK_UNSUPPORTED_S
        self._unsupported = False
        self.table.update(listing, requested_at=requested_at)
        return self.interval if self.table.usable else RECHECK_UNSUPPORTED_S

    def _note_failure(self, exc: LLMPlatformError) -> None:
        """Say so once per outage (reads every interval would flood the log)."""
        if not self._failing:
            logger.warning("cannot read the controller's worker list (%s); routing from the "
                           "last one for up to %.0f s", exc.message, self.table.max_age)
            self._failing = True
        else:
            logger.debug("worker list still unavailable: %s", exc.message)
