"""The gateway's guard on request bodies: JSON only, never more than the size cap.

A pure ASGI middleware in front of every route. A declared `Content-Length` over the cap is
refused at once, without reading a byte of the body; a body without one (chunked) is read
message by message and refused as soon as the running total passes the cap, so an oversized body
is never held whole in memory (`request_guard.read_body_bounded`, shared with the controller and
the workers). An accepted body is handed to the route as one message (the route reads it whole
anyway); later messages, such as the client's disconnect, pass through.

Upload paths (``POST /v1/files``) take multipart forms instead, under a cap of their own: a
declared length over it is refused at once, and the body is passed on as it arrives, counted,
the route's read failing with a 413 as soon as the count passes the cap (the route spools it to
disk as it parses: openai_api.files).

What one caller may have in flight, and per minute, is the tenant middleware's
(openai_api.tenants), which runs before this one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.errors import InvalidRequestError, LLMPlatformError, PayloadTooLargeError
from llmplatform.openai_api.errors import error_payload
from llmplatform.utils.request_guard import is_json_media_type, read_body_bounded, replay, send_refusal

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class RequestBodyMiddleware:
    """Refuses a body over `max_bytes` (413) and a body declared as anything but JSON (400).

    A request without a Content-Type is taken as JSON (curl sends none with `--data-binary @-`);
    one that says it is something else (a form, plain text) is refused rather than guessed at.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, uploads: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.uploads = dict(uploads or {})
        """Paths whose POST bodies are multipart uploads, and their caps in bytes."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        upload_cap = self.uploads.get(scope["path"]) if scope["method"] == "POST" else None
        if upload_cap is not None:
            try:
                _check_upload_headers(headers, upload_cap)
            except LLMPlatformError as exc:
                await _send_error(send, exc)
                return
            await self.app(scope, _counted(receive, upload_cap), send)
            return
        try:
            self._check_headers(headers)
            body = await read_body_bounded(receive, self.max_bytes)
        except LLMPlatformError as exc:
            await _send_error(send, exc)
            return
        if body is None:  # the client left while sending; nobody is waiting for an answer
            return
        await self.app(scope, replay(body, receive), send)

    def _check_headers(self, headers: Headers) -> None:
        declared = headers.get("content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise InvalidRequestError(f"Invalid Content-Length header: {declared[:40]!r}.") from None
            if length > self.max_bytes:
                raise PayloadTooLargeError.over(self.max_bytes)
        content_type = headers.get("content-type")
        if content_type is not None and not is_json_media_type(content_type):
            raise InvalidRequestError(
                f"Unsupported Content-Type {content_type[:80]!r}; the request body must be JSON "
                "(Content-Type: application/json)."
            )


def _check_upload_headers(headers: Headers, max_bytes: int) -> None:
    """Only the size: what the form lacks is the route's to say (after the key check)."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError.over(max_bytes)


def _counted(receive: Receive, max_bytes: int) -> Receive:
    """`receive`, raising PayloadTooLargeError once the body passes `max_bytes`."""
    total = 0

    async def counting() -> Message:
        nonlocal total
        message = await receive()
        if message["type"] == "http.request":
            total += len(message.get("body", b""))
            if total > max_bytes:
                raise PayloadTooLargeError.over(max_bytes)
        return message

    return counting


async def _send_error(send: Send, exc: LLMPlatformError) -> None:
    # The rest of the body may be left unread, so the connection cannot carry another request.
    await send_refusal(send, exc.http_status, json.dumps(error_payload(exc)).encode())
