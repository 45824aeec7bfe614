"""Per-tenant limits as pure bookkeeping: requests in flight, requests and tokens per minute.

No HTTP, no asyncio; the clock is injected so tests pin exact outcomes. The gateway's tenant
middleware (openai_api.tenants) asks :meth:`TenantLimiter.admit` before a request reaches a
route, gives the place back with :meth:`release` when the answer ends, and charges the tokens
it used with :meth:`charge`.

Per minute is a token bucket, as OpenAI describes its own limits: a bucket holds up to the
limit, is refilled continuously at limit/60 per second, and a request takes one (requests) or,
once it ends, its prompt plus completion tokens (tokens). A full bucket allows a burst of the
whole minute's worth; past it, requests pass at the refill rate. Tokens are charged after the
fact (the gateway cannot know a prompt's tokens before a worker renders it, nor the completion's
before it is generated): a request is admitted while its tenant's token bucket holds more than
zero, and a large one may leave it below zero, which the tenant then waits out.

Memory. Keys are configured, so their buckets are bounded by the configuration; client
addresses (a gateway without keys) are not: a full bucket is the same as none and is dropped
when the table passes `MAX_TENANTS`, and beyond that the least recently seen go first (a
forgotten bucket starts full, which only errs toward admitting). Finding the full buckets is a
scan of the table, on the event loop, so a full table is scanned at most once per quarter of it
added since the last scan (a stream of new addresses costs a few bucket refills each, not a scan
each); in between, only the least recently seen go.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmplatform.openai_api.settings import TenantLimits

MAX_TENANTS = 65536
"""Tenants whose per-minute buckets are remembered at once (see the module docstring)."""
_MINUTE_S = 60.0


class TokenBucket:
    """`capacity` units, refilled at `capacity` per minute; the level may go below zero."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self._at = now

    @property
    def rate(self) -> float:
        """Units refilled per second."""
        return self.capacity / _MINUTE_S

    def refill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now

    def seconds_until(self, level: float) -> float:
        """Seconds until the bucket holds `level` (0 if it does), as of the last refill."""
        return max(0.0, (level - self.level) / self.rate)

    @property
    def full(self) -> bool:
        return self.level >= self.capacity


@dataclass(frozen=True)
class Window:
    """One per-minute limit as the `x-ratelimit-*` headers report it."""

    limit: int
    remaining: int
    reset_s: float
    """Seconds until the bucket is full again (OpenAI: "until the limit resets")."""


@dataclass(frozen=True)
class Decision:
    """What `admit` found: `refused` names the limit hit (None: admitted, and counted)."""

    refused: str | None = None
    """"concurrency", "requests" or "tokens"."""
    retry_after_s: float = 0.0
    requests: Window | None = None
    tokens: Window | None = None


@dataclass
class _Minute:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None


class TenantLimiter:
    """The limits of `TenantLimits` for every tenant, each named by an opaque string."""

    CONCURRENCY_RETRY_S = 1.0
    """Retry-After for a tenant at its concurrency limit: when one of its requests ends is
    unknown; a second is about a short answer's length."""

    def __init__(self, limits: TenantLimits, *, clock: Callable[[], float] = time.monotonic,
                 max_tenants: int = MAX_TENANTS) -> None:
        self.limits = limits
        self._clock = clock
        self._max_tenants = max_tenants
        self._in_flight: dict[str, int] = {}
        self._minutes: OrderedDict[str, _Minute] = OrderedDict()
        self._sweep_every = max(1, max_tenants // 4)
        self._added_since_sweep = 0

    # ---- requests -------------------------------------------------------------------------------

    def admit(self, tenant: str, *, concurrent: bool = True) -> Decision:
        """Take a place for one request of `tenant` if every limit allows it; otherwise take
        nothing and say which limit refused it and when to retry. `concurrent` False: the
        request neither counts towards nor is held back by the in-flight limit (a batch line:
        the batch runner's own concurrency bounds those), only the per-minute ones; release it
        with the same flag."""
        now = self._clock()
        limits = self.limits
        minute = self._minute(tenant, now)
        in_flight = self._in_flight.get(tenant, 0)
        if (concurrent and limits.max_concurrent_requests is not None
                and in_flight >= limits.max_concurrent_requests):
            return Decision("concurrency", self.CONCURRENCY_RETRY_S, *self._windows(minute))
        if minute.requests is not None and minute.requests.level < 1:
            return Decision("requests", minute.requests.seconds_until(1), *self._windows(minute))
        if minute.tokens is not None and minute.tokens.level <= 0:
            # Refilled past zero: one token's worth of time after the debt is paid.
            wait = minute.tokens.seconds_until(0) + 1 / minute.tokens.rate
            return Decision("tokens", wait, *self._windows(minute))
        if minute.requests is not None:
            minute.requests.level -= 1
        if concurrent:
            self._in_flight[tenant] = in_flight + 1
        return Decision(None, 0.0, *self._windows(minute))

    def release(self, tenant: str, *, concurrent: bool = True) -> None:
        """One admitted request of `tenant` ended (however it ended)."""
        if not concurrent:
            return
        count = self._in_flight[tenant] - 1
        if count:
            self._in_flight[tenant] = count
        else:
            del self._in_flight[tenant]

    def charge(self, tenant: str, num_tokens: int) -> None:
        """`tenant` used `num_tokens` (prompt plus completion) of its tokens per minute."""
        if self.limits.max_tokens_per_minute is None or num_tokens <= 0:
            return
        minute = self._minute(tenant, self._clock())
        assert minute.tokens is not None
        minute.tokens.level -= num_tokens

    def num_in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    @property
    def num_tenants_tracked(self) -> int:
        """Tenants with a per-minute bucket remembered (bounded by `max_tenants`)."""
        return len(self._minutes)

    # ---- internals ------------------------------------------------------------------------------

    def _minute(self, tenant: str, now: float) -> _Minute:
        """`tenant`'s buckets, refilled to `now` (made full if it had none)."""
        minute = self._minutes.get(tenant)
        if minute is None:
            limits = self.limits
            minute = _Minute(
                TokenBucket(limits.max_requests_per_minute, now)
                if limits.max_requests_per_minute is not None else None,
                TokenBucket(limits.max_tokens_per_minute, now)
                if limits.max_tokens_per_minute is not None else None)
            if minute.requests is None and minute.tokens is None:
                return minute  # nothing per minute to remember
            self._make_room()
            self._minutes[tenant] = minute
            self._added_since_sweep += 1
        else:
            self._minutes.move_to_end(tenant)
        for bucket in (minute.requests, minute.tokens):
            if bucket is not None:
                bucket.refill(now)
        return minute

    def _make_room(self) -> None:
        if len(self._minutes) < self._max_tenants:
            return
        if self._added_since_sweep >= self._sweep_every:
            self._added_since_sweep = 0
            now = self._clock()
            for name in list(self._minutes):  # full buckets are the same as none
                minute = self._minutes[name]
                for bucket in (minute.requests, minute.tokens):
                    if bucket is not None:
                        bucket.refill(now)
                if all(b is None or b.full for b in (minute.requests, minute.tokens)):
                    del self._minutes[name]
        while len(self._minutes) >= self._max_tenants:
            self._minutes.popitem(last=False)  # least recently seen

    @staticmethod
    def _windows(minute: _Minute) -> tuple[Window | None, Window | None]:
        return tuple(  # type: ignore[return-value]
            Window(limit=b.capacity, remaining=max(0, math.floor(b.level)),
                   reset_s=b.seconds_until(b.capacity)) if b is not None else None
            for b in (minute.requests, minute.tokens))


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def ratelimit_headers(decision: Decision) -> list[tuple[bytes, bytes]]:
    """OpenAI's `x-ratelimit-*` headers for the per-minute limits that are on."""
    headers = []
    for kind, window in (("requests", decision.requests), ("tokens", decision.tokens)):
        if window is None:
            continue
        headers += [(f"x-ratelimit-limit-{kind}".encode(), str(window.limit).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(window.remaining).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), openai_duration(window.reset_s).encode())]
    return headers
