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

    Starlette cancels the body iterator when the client disconnects, but an iterator that has
    not started, or that is suspended at a `yield`, is never closed; `on_close` (closing the
    worker streams, aborting) must run in every case, outside the cancelled scope.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            media_type=self.media_type,
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
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
