"""The choices of one request: one worker stream each, run concurrently, merged in arrival order.

Lifecycle::

    streams = ChoiceStreams(client, address, params_per_choice)
    await streams.start()       # first chunk of every choice read: an error here is an HTTP status
                                # (early=True: or the worker's word that it checked the request)
    async for index, chunk in streams.events(): ...   # interleaved; each choice ends with a
                                                      # chunk whose finish_reason is set
    await streams.aclose()      # always (try/finally): stops the pumps, aborts unfinished work

With several choices, each is pumped by its own task into one bounded queue (backpressure reaches
the worker's TCP connection when the client reads slowly). Cancelling a pump closes its HTTP
stream, which aborts the request on the worker (the one way a request is aborted: the worker's
`/worker_abort` route is for FastChat peers). One choice (nearly every request) needs no merging: its
stream is read in the caller's task, with no pump task or queue between the worker's chunk and
the client (one task switch less on the way to the first token); closing it (`aclose`) closes
the HTTP stream the same way.

A streamed answer need not wait for the first token to begin: when every worker stream says
its worker has checked the request (``ACCEPTED_HEADER``), whatever comes next is output or a
failure of the worker itself, so ``start(early=True)`` returns then, and the gateway sends its
client the answer's headers while the worker computes the prefill (the client reads them
meanwhile, not on the way to the first token). :class:`RequestStreams` keeps failover for that
case: a worker lost before any chunk reached the client is replaced, as before the headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from starlette.requests import Request

from llmplatform.errors import ContextLengthExceededError, LLMPlatformError
from llmplatform.openai_api.errors import ClientDisconnected, UpstreamError
from llmplatform.openai_api.failover import with_failover
from llmplatform.openai_api.fastchat_peer import CumulativeFrames
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.openai_api.worker_wire import ACCEPTED, Accepted, may_try_another_worker
from llmplatform.openai_api.deltas import FinalChunk
from llmplatform.protocol.worker import ChunkLogprobs, WorkerChunk

logger = logging.getLogger("llmplatform.openai_api")

_END = None  # queue marker: this choice's stream is over
_QUEUE_SLOTS_PER_CHOICE = 16

T = TypeVar("T")
P = TypeVar("P")
Event = tuple[int, "WorkerChunk | Accepted | LLMPlatformError | None"]


class ChoiceStreams:
    """One worker stream per params dict; a stream whose params ask for ``n`` outputs (a worker
    that lists ``n``) carries choices ``first .. first + n - 1``, its frames naming theirs by
    ``index``. Choices are numbered in the order of `params`."""

    def __init__(self, client: WorkerClient, address: str, params: Sequence[dict[str, Any]]) -> None:
        assert params, "a request has at least one choice"
        self._client = client
        self._address = address
        # Delta frames (only what is new in each chunk) from a worker of ours; a stock worker
        # ignores the field and sends cumulative chunks, made deltas as they arrive (_read).
        self._params = ([{**p, "stream_deltas": True} for p in params] if client.stream_deltas
                        else list(params))
        self._num_outputs = [int(p.get("n", 1)) for p in self._params]
        self._first_choice = [sum(self._num_outputs[:i]) for i in range(len(self._params))]
        self._queue: asyncio.Queue[Event] = asyncio.Queue(
            maxsize=_QUEUE_SLOTS_PER_CHOICE * sum(self._num_outputs))
        self._tasks: list[asyncio.Task[None]] = []
        self._buffered: list[Event] = []
        self._closed = False
        # One choice: its events, read by whoever iterates (no pump task, no queue).
        self._direct: AsyncGenerator[Event, None] | None = None
        self._accepted_early = False

    @property
    def num_choices(self) -> int:
        return sum(self._num_outputs)

    @property
    def address(self) -> str:
        return self._address

    @property
    def accepted_early(self) -> bool:
        """`start` returned on a worker's word for some choice, before its first chunk."""
        return self._accepted_early

    async def start(self, *, early: bool = False) -> None:
        """Start every stream and wait for each one's first chunk (`early`: or its worker's word
        that it checked the request); raise the first error seen."""
        if len(self._params) == 1:
            self._direct = self._read(0)
            try:
                event = await anext(self._direct)
                if event[1] is ACCEPTED:
                    if early:
                        self._accepted_early = True
                        return
                    event = await anext(self._direct)
                if isinstance(event[1], LLMPlatformError):
                    raise event[1]
            except BaseException:
                await self.aclose()
                raise
            self._buffered.append(event)
            return
        self._tasks = [
            asyncio.create_task(self._pump(i), name=f"worker-stream-{self._params[i].get('request_id')}")
            for i in range(len(self._params))
        ]
        waiting = set(range(len(self._params)))  # streams without a first event yet
        try:
            while waiting:
                event = await self._queue.get()
                index, payload = event
                stream = self._stream_of(index)
                if isinstance(payload, LLMPlatformError):
                    raise payload
                if payload is ACCEPTED:
                    if early and stream in waiting:
                        self._accepted_early = True
                        waiting.discard(stream)
                    continue
                self._buffered.append(event)
                waiting.discard(stream)
        except BaseException:
            await self.aclose()
            raise

    async def events(self) -> AsyncIterator[tuple[int, WorkerChunk]]:
        """Chunks of all choices as they arrive, with their choice index; a mid-stream error
        raises."""
        num_open = len(self._params)  # streams, each ending with one _END
        while num_open:
            if self._buffered:
                index, payload = self._buffered.pop(0)
            elif self._direct is not None:
                index, payload = await anext(self._direct)
            else:
                index, payload = await self._queue.get()
            if payload is ACCEPTED:
                continue
            if payload is _END:
                num_open -= 1
            elif isinstance(payload, LLMPlatformError):
                raise payload
            else:
                yield index, payload

    def cancel(self) -> None:
        """Stop every pump now (no await: safe in a finally); a cancelled pump closes its HTTP
        stream, which aborts its choice on the worker."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        self.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._direct is not None:
            try:
                await self._direct.aclose()  # closes the HTTP stream (the worker aborts)
            except RuntimeError:  # still running in a task being torn down; it ends by itself
                pass

    async def _pump(self, index: int) -> None:
        async with contextlib.aclosing(self._read(index)) as events:  # cancelled: closed at once
            async for event in events:
                await self._queue.put(event)

    def _stream_of(self, choice: int) -> int:
        return max(i for i, first in enumerate(self._first_choice) if first <= choice)

    async def _read(self, stream: int) -> AsyncGenerator[Event, None]:
        """One stream's events, each with its choice index: its chunks, then `_END`; or, in
        their place, the error that ended it. Only cancellation (or closing this generator)
        escapes as an exception."""
        first_choice, num_outputs = self._first_choice[stream], self._num_outputs[stream]
        last: dict[int, WorkerChunk] = {}  # by output index
        raw: WorkerChunk | None = None
        cumulative: CumulativeFrames | None = None  # a stock worker's frames (n = 1), made deltas
        try:
            chunks = self._client.generate_stream(self._address, self._params[stream])
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if isinstance(chunk, Accepted):
                        yield first_choice, chunk
                        continue
                    if not 0 <= chunk.index < num_outputs:
                        raise UpstreamError(f"The worker sent output {chunk.index} of {num_outputs}.")
                    if len(last) == num_outputs and all(c.finish_reason is not None for c in last.values()):
                        # Past the final chunk: read on to the end of the body (the worker ends
                        # it at once), so the connection goes back to the pool instead of being
                        # closed half-read and dialled again by the next request.
                        continue
                    raw = chunk
                    if not chunk.delta:
                        cumulative = cumulative or CumulativeFrames()
                        chunk = cumulative.delta(chunk)
                    last[chunk.index] = chunk
                    yield first_choice + chunk.index, chunk
            if not last:
                raise UpstreamError("The worker closed the stream without sending anything.")
            for index in range(num_outputs):
                if index not in last:
                    raise UpstreamError(f"The worker closed the stream without output {index}.")
                if last[index].finish_reason is None:
                    # A worker that ends without a reason: the text it sent is all there is.
                    if cumulative is not None and raw is not None:  # what it held back, now final
                        yield first_choice, cumulative.delta(raw.model_copy(update={"finish_reason": "stop"}))
                    else:  # an empty last delta: its text has been passed on already
                        yield first_choice + index, last[index].model_copy(update={
                            "finish_reason": "stop", "text": "",
                            "logprobs": None if last[index].logprobs is None else ChunkLogprobs()})
            yield first_choice, _END
        except LLMPlatformError as exc:
            yield first_choice, exc
        except Exception as exc:  # a bug here must reach the client as a 500, not hang it
            logger.exception("worker stream %d failed unexpectedly", stream)
            yield first_choice, LLMPlatformError(f"internal error: {type(exc).__name__}")


async def start_choices(client: WorkerClient, address: str, params: Sequence[dict[str, Any]], *,
                        prompt_param: str, early: bool = False) -> ChoiceStreams:
    """One worker stream per choice, each read up to its first chunk (`early`, for a streamed
    answer: or up to the worker's word that it checked the request) before the client is
    answered, so that an early error gets a proper status and a worker that cannot take the
    request is replaced by another (:func:`with_failover`). A worker's context-overflow refusal
    names the request's prompt field, `prompt_param` (the worker's in-stream error carries a
    code and a message, not the OpenAI param)."""
    streams = ChoiceStreams(client, address, params)
    try:
        await streams.start(early=early)
    except ContextLengthExceededError as exc:
        if exc.param is None:
            exc.param = prompt_param
        raise
    return streams


class RequestStreams(Generic[P]):
    """One request's choice streams, started on a worker by `start_on` with failover
    (:func:`with_failover`), and kept failing over after a worker's early acceptance: a worker
    lost before any chunk reached the client is replaced by another (the client has had the
    answer's headers, nothing else). ``prepared`` is what `start_on` returned with the streams
    now in use."""

    def __init__(self, client: WorkerClient, model: str,
                 start_on: Callable[[str], Awaitable[tuple[P, ChoiceStreams]]]) -> None:
        self._client = client
        self._model = model
        self._start_on = start_on
        self._tried: list[str] = []
        self._yielded = False
        self.prepared: P
        self._streams: ChoiceStreams
        self._last: list[WorkerChunk | None] = []

    async def start(self, address: str) -> None:
        self.prepared, self._streams = await with_failover(self._client, self._model, self._start_on,
                                                           address=address)
        self._last = [None] * self._streams.num_choices

    @property
    def last_chunks(self) -> list[WorkerChunk | None]:
        """Each choice's latest chunk so far (None: none yet): their usage is what was used."""
        return list(self._last)

    @property
    def num_choices(self) -> int:
        return self._streams.num_choices

    @property
    def accepted_early(self) -> bool:
        return self._streams.accepted_early

    async def events(self) -> AsyncIterator[tuple[int, WorkerChunk]]:
        while True:
            streams = self._streams
            try:
                async for item in streams.events():
                    self._yielded = True
                    self._last[item[0]] = item[1]
                    yield item
                return
            except LLMPlatformError as exc:
                if self._yielded or not may_try_another_worker(exc):
                    raise
                logger.warning("worker %s was lost after accepting a request for %s, before its first "
                               "chunk (%s: %s); trying another", streams.address, self._model,
                               type(exc).__name__, exc.message)
                self._client.worker_failed(streams.address)
                self._tried.append(streams.address)
                await streams.aclose()
                self.prepared, self._streams = await with_failover(
                    self._client, self._model, self._start_on, tried=self._tried, last=exc)
                self._last = [None] * self._streams.num_choices

    async def final_chunks(self) -> list[WorkerChunk]:
        """Run every stream to its end; each choice's whole result as one cumulative chunk."""
        finals = [FinalChunk() for _ in range(self.num_choices)]
        async for index, chunk in self.events():
            finals[index].add(chunk)
        results = [final.result() for final in finals]
        assert all(chunk is not None for chunk in results), "every pump ends with a final chunk"
        return results  # type: ignore[return-value]

    def cancel(self) -> None:
        self._streams.cancel()

    async def aclose(self) -> None:
        await self._streams.aclose()


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, unless the client disconnects first: then cancel it and raise
    ClientDisconnected (a non-streamed answer nobody will read should not keep a worker busy)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
