"""The gateway's guard on request bodies: JSON only, and never more than the size cap.

A pure ASGI middleware in front of every route. A declared `Content-Length` over the cap is
refused at once, without reading a byte of the body; a body without one (chunked) is read
message by message and refused as soon as the running total passes the cap, so an oversized body
is never held whole in memory. An accepted body is handed to the route as one message (the route
reads it whole anyway); later messages, such as the client's disconnect, pass through.
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.errors import InvalidRequestError, LLMPlatformError
from llmplatform.openai_api.errors import PayloadTooLargeError, error_payload

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json_media_type(content_type: str) -> bool:
    """`application/json`, optionally with parameters (`; charset=utf-8`), or any `+json` type."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class RequestBodyMiddleware:
    """Refuses a body over `max_bytes` (413) and a body declared as anything but JSON (400).

    A request without a Content-Type is taken as JSON (curl sends none with `--data-binary @-`);
    one that says it is something else (a form, plain text) is refused rather than guessed at.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self._check_headers(headers)
            body = await self._read_bounded(receive)
        except LLMPlatformError as exc:
            await _send_error(send, exc)
            return
        if body is None:  # the client left while sending; nobody is waiting for an answer
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_headers(self, headers: Headers) -> None:
        declared = headers.get("content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise InvalidRequestError(f"Invalid Content-Length header: {declared[:40]!r}.") from None
            if length > self.max_bytes:
                raise self._too_large()
        content_type = headers.get("content-type")
        if content_type is not None and not is_json_media_type(content_type):
            raise InvalidRequestError(
                f"Unsupported Content-Type {content_type[:80]!r}; the request body must be JSON "
                "(Content-Type: application/json)."
            )

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"The request body is too large: this server accepts at most {self.max_bytes} bytes."
        )


async def _send_error(send: Send, exc: LLMPlatformError) -> None:
    body = json.dumps(error_payload(exc)).encode()
    # The rest of the body is left unread, so the connection cannot carry another request.
    await send({"type": "http.response.start", "status": exc.http_status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
