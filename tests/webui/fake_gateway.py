"""A scripted OpenAI-compatible gateway for web UI tests that are about what the UI does with an
answer (renders it, shows an error, logs a vote), not about generating one.

Each model id maps to a `Reply`: a text streamed in a few chunks (OpenAI's SSE format), a refusal
with a status and an OpenAI error envelope, or a stream that breaks off with an `error` event.
A reply may carry tool calls: streamed as OpenAI streams them (`delta.tool_calls` with `index`,
`id`, `type` and `function.name` first, then `function.arguments` in pieces of
`argument_piece_chars`), and `finish_reason: "tool_calls"`. A request without `stream` gets the
whole `chat.completion` at once. A reply can also refuse requests that carry given fields, as
the gateway does for a worker that cannot honour them. The requests it received are kept for
assertions.
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
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    """(function name, arguments string) of each call, after the text."""
    argument_piece_chars: int = 3
    unsupported: tuple[str, ...] = ()
    """Request fields this model's worker cannot honour: a request with any of them gets a 400."""
    reasoning: str = ""
    """A reasoning model's thoughts, streamed before `text` as our gateway streams them
    (``reasoning_content`` and ``reasoning`` deltas)."""

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"


UNSUPPORTED_MESSAGE = "this model's worker does not support tools/response_format"


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
            if any(body.get(name) is not None for name in reply.unsupported):
                return _refusal(400, UNSUPPORTED_MESSAGE)
            if not body.get("stream"):
                return _completion(body["model"], reply)
            return StreamingResponse(_events(body["model"], reply),
                                     media_type="text/event-stream")

        return app


def _refusal(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": status}}, status_code=status)


def _call_id(index: int) -> str:
    return f"call_fake{index}"


def _completion(model: str, reply: Reply) -> JSONResponse:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.reasoning:
        message["reasoning_content"] = message["reasoning"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": _call_id(i), "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(reply.tool_calls)]
    return JSONResponse({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _deltas(reply: Reply) -> Iterator[dict[str, Any]]:
    step = max(1, -(-len(reply.reasoning) // reply.num_chunks))
    for i in range(0, len(reply.reasoning), step):
        piece = reply.reasoning[i:i + step]
        yield {"reasoning_content": piece, "reasoning": piece}
    step = max(1, -(-len(reply.text) // reply.num_chunks))
    for i in range(0, len(reply.text), step):
        yield {"content": reply.text[i:i + step]}
    for index, (name, arguments) in enumerate(reply.tool_calls):
        yield {"tool_calls": [{"index": index, "id": _call_id(index), "type": "function",
                               "function": {"name": name, "arguments": ""}}]}
        piece = reply.argument_piece_chars
        for i in range(0, len(arguments), piece):
            yield {"tool_calls": [{"index": index,
                                   "function": {"arguments": arguments[i:i + piece]}}]}


def _events(model: str, reply: Reply) -> Iterator[str]:
    for delta in _deltas(reply):
        yield _sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    if reply.stream_error is not None:
        yield _sse({"error": reply.stream_error})
        return
    yield _sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
