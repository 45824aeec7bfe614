"""Which generation requests a worker takes on, and how it says no.

A worker holds every request it accepted until the request ends: it runs in one of
``limit_worker_concurrency`` slots, or waits (for a slot, or inside the backend's own queue).
The wait is bounded: when ``max_queue_len`` requests already wait, a new one is refused at once
with HTTP 429 and ``Retry-After`` (FastChat's code 42903), so overload costs the client one
round trip instead of an unbounded queue and a timeout; the gateway then tries another worker or
passes the 429 on. A worker whose engine died, or that is shutting down, answers 503 at once.

Counting is exact and leak-free by construction: a :class:`Ticket` is taken synchronously in
the route (no await between the check and the count, so concurrent arrivals cannot all slip
under the limit) and released exactly once, by the generation's own ``finally`` or, if the
response never started, by the response object.

The ticket also holds the request's id (:meth:`Ticket.reserve_id`, the one place ids are
checked for uniqueness) and its :class:`Generation`, which is how ``/worker_abort`` finds the
request: an abort closes the request's stream, exactly as a client that hangs up does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from llmplatform.errors import (EngineDeadError, EngineOverloadedError, ErrorCode,
                                InvalidRequestError, LLMPlatformError)
from llmplatform.llm.base import GenerateChunk, LLMBackend


class WorkerDrainingError(LLMPlatformError):
    """The worker is shutting down and takes no new work (HTTP 503; try another worker)."""

    error_code = ErrorCode.INTERNAL_ERROR
    http_status = 503
    openai_type = "service_unavailable"


class WorkerOverloadedError(EngineOverloadedError):
    """The worker's queue is full (HTTP 429); ``retry_after`` seconds is a fair wait."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerState:
    """Requests this worker has accepted, the slots they hold, and whether it still takes more."""

    def __init__(self, limit: int, max_queue_len: int, retry_after: int = 1) -> None:
        if limit < 1:
            raise ValueError(f"limit_worker_concurrency must be at least 1, got {limit}")
        if max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.semaphore = asyncio.Semaphore(limit)
        self.limit = limit
        self.max_queue_len = max_queue_len
        self.retry_after = retry_after
        self.num_accepted = 0
        """Accepted and not yet finished: waiting or running."""
        self.num_in_slot = 0
        """Holding a concurrency slot (handed to the backend)."""
        self.draining = False
        self.generations: dict[str, Generation] = {}
        """Accepted requests by id (ids are unique among them), for /worker_abort."""

    def num_queued(self, backend_waiting: int) -> int:
        """Requests accepted but not generating yet: waiting for a slot or in the backend's queue."""
        return self.num_accepted - self.num_in_slot + backend_waiting

    def admit(self, llm: LLMBackend) -> Ticket:
        """A ticket for one more request, or the typed refusal (503 or 429) to answer with."""
        if self.draining:
            raise WorkerDrainingError("This worker is shutting down; send the request to another worker.")
        if not llm.is_healthy():
            raise EngineDeadError("This worker's engine is not serving (it failed, and is restarting or has stopped); "
                                  "retry the request.")
        queued = self.num_queued(llm.load().num_waiting)
        if queued >= self.max_queue_len:
            raise WorkerOverloadedError(
                f"This worker is overloaded: {queued} requests are already waiting (limit "
                f"{self.max_queue_len}). Retry after {self.retry_after} s.",
                retry_after=self.retry_after)
        return Ticket(self)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the concurrency slots (waiting for one if all are taken)."""
        async with self.semaphore:
            self.num_in_slot += 1
            try:
                yield
            finally:
                self.num_in_slot -= 1


class Ticket:
    """One accepted request; :meth:`release` is idempotent."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._held = True
        self.generation: Generation | None = None
        state.num_accepted += 1

    def reserve_id(self, request_id: str) -> Generation:
        """Claims ``request_id`` for this request until the ticket is released; refused when a
        request the worker holds has it (ids name requests for /worker_abort, in logs and in the
        engine: the backends rely on their being unique)."""
        assert self._held and self.generation is None
        if request_id in self._state.generations:
            raise InvalidRequestError(f"request id {request_id!r} is already in use by a running "
                                      "request", param="request_id")
        self.generation = self._state.generations[request_id] = Generation(request_id)
        return self.generation

    def release(self) -> None:
        if self._held:
            self._held = False
            self._state.num_accepted -= 1
            if self.generation is not None:
                del self._state.generations[self.generation.request_id]


class Generation:
    """An accepted request's stream, as an abort reaches it.

    There is one way to abort a request: its stream closes, and the backend's generator frees
    what the request held in its ``finally``. A client hanging up closes it from outside;
    :meth:`abort` (``/worker_abort``) makes the consumer end the stream itself: at once when the
    consumer is waiting for the backend's next chunk (its task is cancelled, and the cancellation
    is taken back once it has closed the backend's generator), else before it asks for the next.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.aborted = False
        self._waiting: asyncio.Task | None = None  # the consumer, while it awaits the backend
        self._cancelled = False  # _waiting was cancelled by abort()

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        if self._waiting is not None:
            self._cancelled = True
            self._waiting.cancel()

    async def next_chunk(self, chunks: AsyncIterator[GenerateChunk]) -> GenerateChunk | None:
        """The backend's next chunk; None once it has no more, or the request was aborted (the
        backend's generator then is closed)."""
        if self.aborted:
            return None
        task = self._waiting = asyncio.current_task()
        assert task is not None
        try:
            return await anext(chunks)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            # Our own cancellation is taken back; anyone else's (a disconnect, a shutdown) goes on.
            if not self._cancelled or task.uncancel() > 0:
                raise
            return None
        finally:
            self._waiting = None
            self._cancelled = False


def refusal_response(exc: LLMPlatformError) -> JSONResponse:
    """A refusal in FastChat's error shape, with its HTTP status (and Retry-After on a 429)."""
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"text": exc.message, "error_code": exc.error_code},
                        status_code=exc.http_status, headers=headers)


class TicketedStreamingResponse(StreamingResponse):
    """A streaming response that ends its generation and releases its ticket however it ends.

    When the client disconnects, Starlette cancels the send loop but leaves a body iterator
    suspended at a ``yield`` unclosed (and one never started, unstarted): its ``finally``, which
    aborts the request in the engine and frees its KV blocks, would wait for garbage collection.
    Closing it here makes the abort immediate, and the ticket keeps the count exact.
    """

    def __init__(self, content: AsyncIterator[bytes], ticket: Ticket,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(content, headers=headers)
        self._ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._close())

    async def _close(self) -> None:
        try:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):  # still running in a dying task
                    await aclose()
        finally:
            self._ticket.release()
