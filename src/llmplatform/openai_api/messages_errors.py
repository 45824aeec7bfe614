"""Anthropic's error envelope and status codes on the Messages routes.

Every refusal on ``/v1/messages`` and below is ``{"type": "error", "error": {"type", "message"}}``
with Anthropic's status for it, whoever refuses: the key check and the limits (middlewares), the
request parsing, a route's typed error, an unexpected failure. Those all answer in OpenAI's
envelope first (:mod:`.errors`, the gateway's one translation of typed errors), and
:class:`AnthropicErrorMiddleware` turns that into Anthropic's on the way out: one place, so no
refusal path on these routes can leak the other dialect's shape. A stream that fails after its
status line reports an ``error`` event instead (:data:`ANTHROPIC_FRAMING`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.errors import LLMPlatformError
from llmplatform.openai_api.auth import is_messages_path
from llmplatform.openai_api.generation import Framing
from llmplatform.protocol.anthropic import ErrorDetail, ErrorResponse, ErrorType

# Anthropic's documented codes: other 4xx are invalid_request_error with their own status.
_CLIENT_ERRORS: dict[int, ErrorType] = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error",
}
OVERLOADED_STATUS = 529
"""Anthropic's "overloaded": ours is 503 (no worker can take the request now)."""


def anthropic_status(status: int) -> tuple[int, ErrorType]:
    """The status and error type Anthropic answers for what the gateway answers `status` for."""
    if status < 500:
        return status, _CLIENT_ERRORS.get(status, "invalid_request_error")
    if status == 503:
        return OVERLOADED_STATUS, "overloaded_error"
    if status == 504:
        return 504, "timeout_error"
    return 500, "api_error"


def error_body(status: int, message: str) -> tuple[int, dict[str, Any]]:
    new_status, kind = anthropic_status(status)
    return new_status, ErrorResponse(error=ErrorDetail(type=kind, message=message)).model_dump()


def _message_of(openai_body: bytes, status: int) -> str:
    """The message of an OpenAI envelope, with the field it names (Anthropic's envelope has no
    ``param``); a body that is not one (none of ours) is described by its status."""
    try:
        error = json.loads(openai_body)["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        return f"The request failed with HTTP status {status}."
    if isinstance(param, str) and param and param not in message:
        return f"{param}: {message}"
    return str(message)


def sse(event_type: str, payload: dict[str, Any] | str) -> bytes:
    """One Anthropic stream event: its type as the SSE event name, its JSON as the data."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"event: {event_type}\ndata: {data}\n\n".encode()


def _error_event(exc: LLMPlatformError) -> bytes:
    return sse("error", error_body(exc.http_status, exc.message)[1])


ANTHROPIC_FRAMING = Framing(_error_event, b"")
"""A Messages stream's failure is an ``error`` event; the stream simply ends (no ``[DONE]``)."""


class AnthropicErrorMiddleware:
    """Rewrites every error answer (status >= 400) on the Messages paths into Anthropic's
    envelope and status. Success answers (and streams) pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body: list[bytes] = []

        async def sending(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole (small, JSON) error body is in
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, payload = error_body(start["status"], _message_of(b"".join(body), start["status"]))
            data = json.dumps(payload).encode()
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", str(len(data)).encode())]
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        await self.app(scope, receive, sending)
