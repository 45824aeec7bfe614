"""Server-sent events: framing and a streaming response that always cleans up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], *, exclude: set[str] | None = None) -> bytes:
    """One `data: {json}` event."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload, ensure_ascii=False)
    return b"data: " + body.encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that runs `on_close` however the stream ends.

    Sent by its own loop rather than Starlette's: that one runs each response in an AnyIO task
    group with a second task listening for the disconnect, which costs a gateway (one streamed
    response per request) measurable time per request. Here one plain asyncio task waits for
    the client's disconnect and cancels the sending; the cancellation is then taken back, so the
    request ends normally for the middlewares and the server, as with Starlette's.

    The status line and headers go out with the first event rather than ahead of it (the client
    wakes once for both), unless ``headers_first``: then at once, for an answer whose first event
    is a while away (a prefill) and whose status is settled, so that the client reads the
    headers meanwhile, not on the way to its first token. A Python client (httpx, under the
    official ``openai`` one) takes a few hundred microseconds over a response's headers.

    The body iterator is closed and `on_close` (closing the worker streams, aborting) runs in
    every case: an iterator that has not started, or that is suspended at a `yield`, is never
    closed by anyone else.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers_first: bool = False,
    ) -> None:
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type=self.media_type,
        )
        self._on_close = on_close
        self._headers_first = headers_first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"sending": True, "disconnected": False}

        async def watch() -> None:
            # The request body has been read: what comes next is the disconnect (which uvicorn
            # also reports once the response is complete, hence `sending`).
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["sending"]:
                state["disconnected"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            started = self._headers_first
            if started:
                await send(start)
            async for chunk in self.body_iterator:
                if not started:
                    started = True
                    await send(start)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not started:
                await send(start)
            state["sending"] = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["disconnected"] or task.cancelling() > 1:
                raise
            task.uncancel()  # ours, for the client's disconnect: the exchange is simply over
        finally:
            state["sending"] = False
            watcher.cancel()
            await asyncio.shield(self._close())

    async def _close(self) -> None:
        aclose = getattr(self.body_iterator, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        except RuntimeError:  # still running in a task being torn down; it finishes by itself
            pass
        finally:
            if self._on_close is not None:
                await self._on_close()
