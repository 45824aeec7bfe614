"""The gateway's guard on request bodies: JSON only, never more than the size cap, and at most
`max_streams_per_key` streams at once per caller.

A pure ASGI middleware in front of every route. A declared `Content-Length` over the cap is
refused at once, without reading a byte of the body; a body without one (chunked) is read
message by message and refused as soon as the running total passes the cap, so an oversized body
is never held whole in memory (`request_guard.read_body_bounded`, shared with the controller and
the workers). An accepted body is handed to the route as one message (the route reads it whole
anyway); later messages, such as the client's disconnect, pass through.

Streams per caller: a streamed generation holds a worker slot for as long as the client keeps it
open, so one caller opening hundreds could take every slot of a cluster. With
`max_streams_per_key`, a streamed request (`"stream": true` on a generation route) beyond that
many open ones of the same caller is refused with 429 and OpenAI's envelope, before any worker
is asked. The caller is its API key (the API-key check runs first, so it is a valid key, and
there are only as many callers as keys). A gateway without keys has no other name for a caller
than the client's address: behind a reverse proxy every client shares the proxy's, so there
the cap is one for all of them together; set it with that in mind, or leave it off (the
default). A stream's place is given back when its response ends, however it ends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llmplatform.errors import EngineOverloadedError, InvalidRequestError, LLMPlatformError, PayloadTooLargeError
from llmplatform.openai_api.errors import error_payload
from llmplatform.utils.request_guard import is_json_media_type, read_body_bounded, replay, send_refusal

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_STREAM_RETRY_AFTER_S = 1


class TooManyStreamsError(EngineOverloadedError):
    """The caller already has `max_streams_per_key` streams open (HTTP 429)."""

    openai_code = "rate_limit_exceeded"


class StreamCounter:
    """Open streams per caller; `try_open` takes a place if one is free, `close` gives it back.
    Callers with no open stream are forgotten, so the table holds only the callers streaming."""

    def __init__(self, max_per_caller: int) -> None:
        if max_per_caller < 1:
            raise ValueError(f"max_per_caller must be >= 1, got {max_per_caller}")
        self.max_per_caller = max_per_caller
        self._open: dict[bytes, int] = {}

    def try_open(self, caller: bytes) -> bool:
        count = self._open.get(caller, 0)
        if count >= self.max_per_caller:
            return False
        self._open[caller] = count + 1
        return True

    def close(self, caller: bytes) -> None:
        count = self._open[caller] - 1
        if count:
            self._open[caller] = count
        else:
            del self._open[caller]

    def num_open(self, caller: bytes) -> int:
        return self._open.get(caller, 0)


class RequestBodyMiddleware:
    """Refuses a body over `max_bytes` (413), a body declared as anything but JSON (400) and,
    with `max_streams_per_key`, a stream on `stream_paths` past the caller's cap (429).

    A request without a Content-Type is taken as JSON (curl sends none with `--data-binary @-`);
    one that says it is something else (a form, plain text) is refused rather than guessed at.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, max_streams_per_key: int | None = None,
                 stream_paths: Collection[str] = (), keyed: bool = False) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._streams = StreamCounter(max_streams_per_key) if max_streams_per_key else None
        self._stream_paths = frozenset(stream_paths)
        # Without configured keys any bearer token passes: callers are told apart by address.
        self._keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self._check_headers(headers)
            body = await read_body_bounded(receive, self.max_bytes)
        except LLMPlatformError as exc:
            await _send_error(send, exc)
            return
        if body is None:  # the client left while sending; nobody is waiting for an answer
            return
        if self._streams is None or scope["path"] not in self._stream_paths or not _asks_to_stream(body):
            await self.app(scope, replay(body, receive), send)
            return
        caller = _caller(scope, headers, keyed=self._keyed)
        if not self._streams.try_open(caller):
            limit = self._streams.max_per_caller
            await _send_error(send, TooManyStreamsError(
                f"Too many concurrent streams: at most {limit} may be open at once for one "
                f"{'API key' if caller.startswith(b'key:') else 'client address'}; retry when one "
                "ends."), retry_after=_STREAM_RETRY_AFTER_S)
            return
        try:
            await self.app(scope, replay(body, receive), send)
        finally:
            self._streams.close(caller)

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



def _asks_to_stream(body: bytes) -> bool:
    """`"stream": true` in a JSON object; anything unparsable is the route's to refuse."""
    if b'"stream"' not in body:  # most requests: no second parse
        return False
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(request, dict) and request.get("stream") is True


def _caller(scope: Scope, headers: Headers, *, keyed: bool) -> bytes:
    """With keys (`keyed`), the digest of the request's key (checked already); else the client's
    address."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if keyed and scheme.lower() == "bearer" and token.strip():
        return b"key:" + hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
    client = scope.get("client")
    return b"addr:" + (client[0] if client else "").encode()


async def _send_error(send: Send, exc: LLMPlatformError, *, retry_after: int | None = None) -> None:
    extra = [(b"retry-after", str(retry_after).encode())] if retry_after is not None else []
    # The rest of the body may be left unread, so the connection cannot carry another request.
    await send_refusal(send, exc.http_status, json.dumps(error_payload(exc)).encode(), extra)
