"""One HTTP/1.1 connection to a worker, one exchange at a time (the protocol under
``worker_stream.WorkerStreamClient``'s pool).

The answer is parsed by httptools (the C parser uvicorn already uses) as it arrives, chunked
bodies decoded there; its body pieces wait in a queue for the reader, and past
``HIGH_WATER_BYTES`` not yet read the socket stops being read (backpressure). A connection that
ends before its answer does fails the exchange with :class:`ConnectionGone`, which says whether
any byte of the answer came (a pooled connection the worker closed while idle: the request can
be sent again).
"""

from __future__ import annotations

import asyncio
import collections

import httptools

HIGH_WATER_BYTES = 1 << 20
"""Body bytes received but not yet read past which the socket stops being read (backpressure)."""


class ConnectionGone(Exception):
    """The connection ended before the answer did (``before_answer``: not one byte of it)."""

    def __init__(self, reason: str, *, before_answer: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.before_answer = before_answer


class WorkerConnection(asyncio.Protocol):
    """One HTTP/1.1 connection, one exchange at a time: httptools callbacks fill the answer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.got_bytes = False
        self.keep_alive = False
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: ConnectionGone | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timed_out = False

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"a malformed HTTP answer ({exc})")
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and not self.complete and "content-length" not in self.headers \
                and "chunked" not in self.headers.get("transfer-encoding", "").lower():
            self.complete = True  # a body delimited by the end of the connection
        if not self.complete:
            reason = type(exc).__name__ if exc is not None else "closed by the worker"
            self._fail(reason)
        self._wake()

    # ---- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # ---- the exchange --------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self._error is None and not self.complete:
            self._error = ConnectionGone(reason, before_answer=not self.got_bytes)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout: float) -> None:
        """Until the next callback; asyncio.TimeoutError after `timeout` seconds without one."""
        waiter = self._waiter = self._loop.create_future()
        self._timed_out = False
        timer = self._loop.call_later(timeout, self._expire)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._timed_out:
            raise asyncio.TimeoutError

    def _expire(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._timed_out = True
            waiter.set_result(None)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        if self._paused:  # not after an answer read to its end, but a reused connection must read
            self.transport.resume_reading()
        self._reset_exchange()
        self.transport.write(data)

    async def wait_headers(self, timeout: float) -> None:
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            await self._wait(timeout)

    async def read_some(self, timeout: float) -> bytes | None:
        """The next piece of the body; None at its end."""
        while not self._body:
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            await self._wait(timeout)
        data = self._body.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered <= HIGH_WATER_BYTES // 4 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_all(self, timeout: float) -> bytes:
        pieces = []
        while (data := await self.read_some(timeout)) is not None:
            pieces.append(data)
        return b"".join(pieces)

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
