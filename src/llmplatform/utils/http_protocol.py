"""uvicorn's httptools protocol, guarded against slow and greedy clients.

The services' protocol (:func:`protocol_for`, passed as uvicorn's ``http`` by
:mod:`llmplatform.utils.server`) is uvicorn's own ``HttpToolsProtocol`` with what uvicorn lacks,
within the bounds of one :class:`ConnectionLimits`:

- **Slow heads and bodies** (slowloris): a request's head must be complete within
  ``head_timeout_s`` of the connection opening (or, on a kept-alive connection, of the request's
  first byte), and its body within ``body_timeout_s`` of the head. Past either, the connection is
  closed; a route still waiting for the body sees the client's disconnect. A body that times
  out is answered 408 first (when nothing was answered yet), and its request's scope is marked
  (``BODY_TIMED_OUT`` in ``scope["state"]``) so that the access log and the metrics, which would
  otherwise see an app that returned without answering (a 500), count it as the 408 it is. uvicorn has neither
  deadline: its keep-alive timer only runs between requests, so a client sending a header byte
  a second holds a connection (and a file descriptor) for ever. A deadline that passes while
  the server itself has paused reading (a pipelined request queued behind a slow answer, a body
  the route has not read yet) is not the client's fault and is pushed back.
- **Stalled readers**: when the response cannot be written because the client stopped reading
  (the transport's buffer stays above its high-water mark, 64 KiB on top of the kernel's socket
  buffer) for ``write_stall_timeout_s``, the connection is aborted. uvicorn would otherwise leave
  the route blocked in ``send`` for good; aborting reports the disconnect to the route, which
  ends the stream and aborts the generation down to the engine, freeing its slot.
- **Too many connections**: beyond ``max_connections`` open connections a new one is refused as
  it is accepted (a 503 written, then closed). uvicorn's ``limit_concurrency`` answers 503 too, but
  only once a request's head has arrived, so idle or slow connections past the cap still hold
  their descriptors until a deadline ends them, and it counts the connection asking (a cap of
  N serves N-1).

Writes go to the transport as uvicorn makes them. Holding one loop turn's writes to send them
together (the headers with the first event) was tried and measured: no gain over plain httptools
(``benchmarks/infra_http_protocol.py``, docs/performance.md "Hand-written infrastructure").
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("llmplatform.server")

DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_HEAD_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_WRITE_STALL_TIMEOUT_S = 30.0
_REFUSAL_LOG_INTERVAL_S = 10.0
BODY_TIMED_OUT = "llmplatform_body_timed_out"
"""Key set (True) in a request's ``scope["state"]`` when its body did not arrive in time."""
_BODY_TIMEOUT_BODY = (b'{"error": {"message": "The request body did not arrive in time.", '
                      b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')
_BODY_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: " + str(len(_BODY_TIMEOUT_BODY)).encode()
                 + b"\r\n\r\n" + _BODY_TIMEOUT_BODY)
_OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"retry-after: 1\r\nconnection: close\r\ncontent-length: 46\r\n\r\n"
                  b"Service Unavailable: too many open connections")


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-service bounds on what one connection may hold (see the module doc)."""

    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    """Open connections at most; a new one beyond is refused at accept. None: no cap."""
    head_timeout_s: float | None = DEFAULT_HEAD_TIMEOUT_S
    """Seconds from a connection's opening (later requests: their first byte) to the end of the
    request's head. None: no deadline."""
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    """Seconds from the end of a request's head to the end of its body. None: no deadline."""
    write_stall_timeout_s: float | None = DEFAULT_WRITE_STALL_TIMEOUT_S
    """Seconds a response may wait on a client that does not read before the connection is
    aborted. None: wait for ever."""
    send_buffer_bytes: int | None = None
    """The accepted sockets' SO_SNDBUF; None: the kernel's own (autotuned) size. On loopback the
    kernel lets a client that never reads take megabytes (64 KiB segments), on a real network
    tens of kilobytes: tests set this to see a stall as a real network would show it."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "send_buffer_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("head_timeout_s", "body_timeout_s", "write_stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds or None, got {value!r}")


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the cap of ``limits`` (module doc)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    _last_refusal_log: ClassVar[float] = 0.0
    _num_refused_unlogged: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) >= cap:
            self._refuse(transport)
            return
        if self.limits.send_buffer_bytes is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        super().connection_made(transport)
        self._head_timer = self._arm(self.limits.head_timeout_s, self._head_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:  # never became one of the server's connections
            return
        for timer in (self._head_timer, self._body_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._stall_timer = None
        super().connection_lost(exc)

    # ---- deadlines on the request ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a later request on a kept-alive connection
            self._head_timer = self._arm(self.limits.head_timeout_s, self._head_expired)

    def on_headers_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        self._body_timer = self._arm(self.limits.body_timeout_s, self._body_expired)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_expired(self) -> None:
        self._head_timer = self._expired("head", self.limits.head_timeout_s, self._head_expired)

    def _body_expired(self) -> None:
        self._body_timer = self._expired("body", self.limits.body_timeout_s, self._body_expired)

    def _expired(self, part: str, timeout_s: float | None, again: Any) -> asyncio.TimerHandle | None:
        if self.transport.is_closing():
            return None
        if self.flow.read_paused:  # the server is not reading: not the client's delay
            return self._arm(timeout_s, again)
        answered = ""
        if part == "body" and self.cycle is not None and not self.cycle.response_started:
            # The app is still waiting for the body: it will see a disconnect and answer
            # nothing, so the answer is ours. Once the transport closes, uvicorn drops the app's
            # sends (the cycle is disconnected before the app runs again).
            self.scope.setdefault("state", {})[BODY_TIMED_OUT] = True  # type: ignore[typeddict-item]
            self.cycle.response_started = True
            self.transport.write(_BODY_TIMEOUT)
            answered = " (408)"
        logger.warning("closing the connection from %s: the request's %s did not arrive within %g s%s",
                       _peer(self.client), part, timeout_s, answered)
        self.transport.close()
        return None

    # ---- a client that stops reading ---------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self._arm(self.limits.write_stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        logger.warning("aborting the connection from %s: it has not read its response for %g s",
                       _peer(self.client), self.limits.write_stall_timeout_s)
        self.transport.abort()  # close() would wait for the unread buffer to drain

    # ---- too many connections ---------------------------------------------------------------------

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused = True
        cls = GuardedHttpToolsProtocol
        cls._num_refused_unlogged += 1
        now = time.monotonic()
        if now - cls._last_refusal_log >= _REFUSAL_LOG_INTERVAL_S:
            logger.warning("refused %d connection(s) since the last such line: %d are open, the "
                           "cap (--max-connections)", cls._num_refused_unlogged, len(self.connections))
            cls._last_refusal_log = now
            cls._num_refused_unlogged = 0
        # Best effort: a client that already sent its request may see a reset instead.
        transport.write(_OVER_CAPACITY)
        transport.close()

    def _arm(self, timeout_s: float | None, callback: Any) -> asyncio.TimerHandle | None:
        return None if timeout_s is None else self.loop.call_later(timeout_s, callback)


def protocol_for(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn is given (it builds one per connection, from the class)."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
