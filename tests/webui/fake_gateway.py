"""A scripted OpenAI-compatible gateway for web UI tests that are about what the UI does with an
answer (renders it, shows an error, logs a vote), not about generating one.

Each model id maps to a `Reply`: a text streamed in a few chunks (OpenAI's SSE format), a refusal
with a status and an OpenAI error envelope, or a stream that breaks off with an `error` event.
The requests it received are kept for assertions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Reply:
    text: str = ""
    status: int = 200
    """Not 200: the request is refused with this status and `error_message`."""
    error_message: str = ""
    stream_error: dict[str, Any] | None = None
    """After `text`, an SSE `error` event with this inner error object."""
    num_chunks: int = 4


@dataclass
class FakeGateway:
    replies: dict[str, Reply] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "test"}
                for name in self.replies]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            reply = self.replies.get(body.get("model"))
            if reply is None:
                return _refusal(404, f"The model `{body.get('model')}` does not exist.")
            if reply.status != 200:
                return _refusal(reply.status, reply.error_message)
            return StreamingResponse(_events(body["model"], reply),
                                     media_type="text/event-stream")

        return app


def _refusal(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": status}}, status_code=status)


def _events(model: str, reply: Reply) -> Iterator[str]:
    step = max(1, -(-len(reply.text) // reply.num_chunks))
    pieces = [reply.text[i:i + step] for i in range(0, len(reply.text), step)]
    for piece in pieces:
        yield _sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "delta": {"content": piece},
                                 "finish_reason": None}]})
    if reply.stream_error is not None:
        yield _sse({"error": reply.stream_error})
        return
    yield _sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
