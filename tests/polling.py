"""The one way tests wait for something that happens on another thread, process or server.

`wait_until(predicate, what=...)` calls `predicate` every `interval_s` until it returns something
truthy and returns that value. When `timeout_s` passes first it raises `WaitTimeout`, an
AssertionError that names what was awaited, the timeout, the last value the predicate returned
and the last exception it raised, so a failed wait reads like a failed assert and can never be
mistaken for success (there is no boolean to forget to assert).

A predicate may raise while a service is still starting (a refused connection, a 503 read as an
error): list those exception types in `retry_on` and the wait goes on; any other exception ends
the wait at once (a predicate can stop a hopeless wait early, say when the process it waits for
has exited, by raising). `context` adds diagnostics to the failure message only (log tails,
process output), computed once, when the wait has failed.

`wait_until_async` is the same for tests running on an event loop: it sleeps with
`asyncio.sleep`, and its predicate may be a coroutine function.

Timeouts are generous on purpose: the test machine is small and shared, and a wait that succeeds
returns as soon as its condition holds, so a long timeout costs nothing when things work.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_INTERVAL_S = 0.05
_NOTHING = object()


class WaitTimeout(AssertionError):
    """A condition a test waited for did not hold within its timeout."""


class _Poll:
    """The bookkeeping both waits share: the deadline, the last outcome, the failure message."""

    def __init__(self, what: str, timeout_s: float, retry_on: tuple[type[BaseException], ...],
                 context: Callable[[], object] | None) -> None:
        self.what, self.timeout_s, self.retry_on, self.context = what, timeout_s, retry_on, context
        self.deadline = time.monotonic() + timeout_s
        self.last_value: object = _NOTHING
        self.last_error: BaseException | None = None

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def failure(self) -> WaitTimeout:
        message = f"timed out after {self.timeout_s} s waiting for {self.what}"
        if self.last_value is not _NOTHING:
            message += f"; last value: {_short(repr(self.last_value))}"
        if self.last_error is not None:
            message += f"; last error: {_short(repr(self.last_error))}"
        if self.context is not None:
            message += f"\n{self.context()}"
        return WaitTimeout(message)


def _short(text: str, max_chars: int = 2000) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def wait_until(predicate: Callable[[], T], *, what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               interval_s: float = DEFAULT_INTERVAL_S, retry_on: tuple[type[BaseException], ...] = (),
               context: Callable[[], object] | None = None) -> T:
    """Poll `predicate` until it returns something truthy and return that; WaitTimeout (an
    AssertionError) after `timeout_s`. The predicate runs at least once, and once more after the
    deadline, so a slow first call never fails a wait unheard."""
    poll = _Poll(what, timeout_s, retry_on, context)
    while True:
        expired = poll.expired()
        try:
            value = predicate()
        except retry_on as exc:
            poll.last_error = exc
        else:
            if value:
                return value
            poll.last_value = value
        if expired:
            raise poll.failure() from poll.last_error
        time.sleep(interval_s)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], *, what: str,
                           timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: float = DEFAULT_INTERVAL_S,
                           retry_on: tuple[type[BaseException], ...] = (),
                           context: Callable[[], object] | None = None) -> T:
    """`wait_until` on an event loop: the predicate may return an awaitable, which is awaited."""
    poll = _Poll(what, timeout_s, retry_on, context)
    while True:
        expired = poll.expired()
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except retry_on as exc:
            poll.last_error = exc
        else:
            if value:
                return value  # type: ignore[return-value]
            poll.last_value = value
        if expired:
            raise poll.failure() from poll.last_error
        await asyncio.sleep(interval_s)
