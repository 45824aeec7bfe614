"""uvicorn's httptools protocol, with the writes of one event-loop turn sent together.

uvicorn writes a response's status line and headers to the socket as soon as the app sends
``http.response.start``, and each body message as it comes: a streamed answer whose headers
and first event are sent back to back leaves in two ``send`` calls, and on loopback each one
wakes the reader (a process hand-off, the expensive part on a small machine). Here the
transport's writes are held until the end of the current loop turn and leave as one: nothing
waits longer than the rest of the turn (no timer, no size threshold), and data never changes
order. ``close()`` sends what is held first; ``abort()`` drops it, as the real one drops its
buffer.

Services pass :class:`CoalescingHttpToolsProtocol` as uvicorn's ``http`` protocol
(:mod:`llmplatform.utils.server`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _TurnBuffer:
    """A transport whose writes leave at the end of the loop turn they were made in."""

    __slots__ = ("_transport", "_loop", "_held", "_scheduled")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._held.append(bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        self._scheduled = False
        if not self._held:
            return
        held = self._held
        self._held = []
        if not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # everything else is the real transport's
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_TurnBuffer(transport, self.loop))  # type: ignore[arg-type]
