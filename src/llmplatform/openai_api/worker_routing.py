"""The gateway's routing table: which worker serves the next request, without asking the controller.

FastChat's gateway asks the controller (`POST /get_worker_address`) before every request: one
more round trip on every request's path. With `--routing local` (the default) a background task
reads the controller's live workers (`GET /list_workers`, ours: every load fact dispatch ranks by,
and the controller's dispatch method) every `--worker-refresh-interval` seconds into the gateway's
router (:class:`~llmplatform.routing.router.Router`, the same code the controller answers
`/get_worker_address` with), and a request picks from it. This module is the gateway's side of
that: reading a listing into the router (:func:`update_from_listing`), keeping it read
(:class:`TableRefresher`), and what a request offers routing (:class:`RouteRequest`).

What the router cannot answer, the controller is asked, exactly as before (a decision is None):

- a model no usable listed worker serves: a worker registered since the last read (usable at
  once), an unknown model (the controller's answer keeps today's 404 and 503), or every listed
  worker excluded by this request's failover or marked down;
- no table at all: not read yet; a controller without `/list_workers` (stock FastChat: 404/405,
  asked again every `RECHECK_UNSUPPORTED_S`); a dispatch method this gateway does not know; or a
  table older than `max_table_age` because the controller stopped answering (the per-request
  calls then give today's clean 503s).

Load between reads (routing/load.py): the router adds its own picks since each worker's last
heartbeat to the controller's count of its own (`num_dispatched`), and, since the gateway sees its
requests end (`request_ended`), takes those off. A read that brings a newer heartbeat drops the
picks and ends before it (the report includes them); a read that brings none keeps them.

cache_aware. When the controller's method is cache_aware, the router runs it with the knobs the
listing carries over the request's :class:`RouteHint`: its own prefix trees, built from its own
picks (a request it hands to the controller is matched there, against the controller's). The
hint is computed here for both paths: the routing text is the completion prompt, or the chat
messages serialized one after another, which extends as a conversation does (the worker's chat
template renders them in the same order), so a conversation's next turn matches its last.

Failures. A worker that could not take a request (`may_try_another_worker`: refused, reset, 503,
429) is marked down in the router until the next read that started after the failure.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmplatform.errors import LLMPlatformError
from llmplatform.protocol.controller import ListWorkersResponse, WorkerDescription
from llmplatform.routing.cache_aware import CacheAwareConfig
from llmplatform.routing.load import RoutedWorker
from llmplatform.routing.policies import DispatchMethod
from llmplatform.routing.prefix_tree import CHUNK_CHARS, MAX_ROUTE_CHUNKS, RouteHint
from llmplatform.routing.router import Router

logger = logging.getLogger("llmplatform.openai_api.worker_routing")

STALE_AFTER_REFRESHES = 10
"""A table not refreshed for this many intervals (the controller is down or silent) is dropped."""
MIN_STALE_AFTER_S = 5.0
"""...but never sooner than this: a short interval must not make a controller hiccup fatal."""
RECHECK_UNSUPPORTED_S = 60.0
"""How often a controller that cannot drive local routing (no `/list_workers`, or an unknown
dispatch method) is asked again, in case it was upgraded."""


def max_table_age(refresh_interval: float) -> float:
    """Seconds a table may go without a successful read before it is dropped."""
    return max(STALE_AFTER_REFRESHES * refresh_interval, MIN_STALE_AFTER_S)


class RouteSource(str, enum.Enum):
    """Where a request's worker came from (the gateway's routing-decision metric)."""

    TABLE = "table"
    CONTROLLER = "controller"


def routed_worker(worker: WorkerDescription, now: float) -> RoutedWorker:
    """One listed worker as routing sees it; its last heartbeat placed on the gateway's clock
    (`now`: when the listing arrived)."""
    return RoutedWorker(
        worker_name=worker.worker_name.rstrip("/"),
        model_names=frozenset(worker.model_names),
        speed=worker.speed,
        queue_length=worker.queue_length,
        num_running=worker.num_running,
        num_waiting=worker.num_waiting,
        kv_cache_usage=worker.kv_cache_usage,
        max_num_running=worker.max_num_running,
        reported_at=now - worker.last_heartbeat_age_s,
        num_dispatched=worker.num_dispatched,
        cache_epoch=worker.cache_epoch,
        prefix_cache_queries=worker.prefix_cache_queries,
    )


def update_from_listing(router: Router, listing: ListWorkersResponse, *, requested_at: float) -> None:
    """Fill `router` from a `/list_workers` read asked for at `requested_at` and answered now:
    the controller's method (with its cache_aware knobs) and its live workers. A listing
    without a dispatch method this gateway knows cannot drive local routing: the router is
    cleared (every request asks the controller)."""
    try:
        method = DispatchMethod(listing.dispatch_method) if listing.dispatch_method else None
    except ValueError:
        method = None
    if method is None:  # the refresher asks again only every RECHECK_UNSUPPORTED_S
        logger.warning("the controller's dispatch method %r is unknown here; routing "
                       "through the controller per request", listing.dispatch_method)
        router.clear()
        return
    options = listing.cache_aware
    router.configure(method, CacheAwareConfig(**options.model_dump(exclude_none=True))
                     if options is not None else None)
    now = router.clock()
    router.update([routed_worker(w, now) for w in listing.workers], requested_at=requested_at)


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
    """Keeps the gateway's :class:`~llmplatform.routing.router.Router` filled from the
    controller, in the background.

    `run` loops until cancelled (the gateway's lifespan does, at shutdown); a failed read is
    logged and the table kept (it ages out by itself), so nothing but cancellation stops it.
    """

    def __init__(
        self,
        table: Router,
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
        update_from_listing(self.table, listing, requested_at=requested_at)
        return self.interval if self.table.usable else RECHECK_UNSUPPORTED_S

    def _note_failure(self, exc: LLMPlatformError) -> None:
        """Say so once per outage (reads every interval would flood the log)."""
        if not self._failing:
            logger.warning("cannot read the controller's worker list (%s); routing from the "
                           "last one for up to %.0f s", exc.message, self.table.max_age)
            self._failing = True
        else:
            logger.debug("worker list still unavailable: %s", exc.message)
