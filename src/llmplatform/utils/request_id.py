"""Request ids across the cluster: the ``X-Request-Id`` header and the ASGI middleware that
puts the id into the logging context (:mod:`llmplatform.utils.logs`) for a whole HTTP exchange.

The gateway names every request: it adopts a client's ``X-Request-Id`` when the value is safe to
log and to reuse inside worker request ids (bounded length, a small charset), and makes a new
one otherwise. It returns the id in the response header (errors included) and sends it on every
call it makes to the controller and workers, whose middleware only adopts it. Generation
requests carry it in the params dict too, in each choice's ``request_id`` (see
:func:`worker_request_id_prefix`).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.utils.logs import REQUEST_ID, install_request_id_logging

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LENGTH = 128
"""Longest client id adopted; longer ones are replaced (they end up in every log line)."""

# Letters, digits and ._:- only: nothing that could forge a log line, a header or a URL part.
_SAFE_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_LENGTH}}}")
_HEADER_KEY = REQUEST_ID_HEADER.lower().encode("latin-1")


def is_valid_request_id(value: str) -> bool:
    return _SAFE_ID.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (a fresh one if it ran without the middleware)."""
    state = request.scope.setdefault("state", {})
    if not state.get("request_id"):
        state["request_id"] = new_request_id()
    return state["request_id"]


def worker_request_id_prefix(request: Request) -> str:
    """The prefix of this request's worker request ids (``<prefix>-<choice>``).

    The request id itself when the gateway made it (unique by construction); a client's id gets
    a random infix, because clients reuse ids (retries) and two running generations must never
    share a worker request id (it names them for aborts and inside the engine).
    """
    request_id = request_id_of(request)
    if request.scope["state"].get("request_id_from_client"):
        return f"{request_id}-{uuid.uuid4().hex[:8]}"
    return request_id


def _header(scope: Scope) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == _HEADER_KEY:
            text = value.decode("latin-1").strip()
            return text if is_valid_request_id(text) else None
    return None


class RequestIdMiddleware:
    """Sets the logging context's request id for each HTTP exchange.

    ``generate=True`` (the gateway): every request gets an id (the client's valid
    ``X-Request-Id`` or a new one), echoed in the response's ``X-Request-Id``. ``generate=False``
    (controller, workers): a valid incoming header is adopted and echoed; without one nothing is
    set (a generation route then uses its params' ``request_id``).
    """

    def __init__(self, app: ASGIApp, *, generate: bool) -> None:
        self.app = app
        self.generate = generate
        install_request_id_logging()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope)
        from_client = request_id is not None
        if request_id is None and self.generate:
            request_id = new_request_id()
        if request_id is None:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["request_id_from_client"] = from_client
        header = (_HEADER_KEY, request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != _HEADER_KEY]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


async def tag_outgoing_request(request: Any) -> None:
    """An httpx ``request`` event hook: the current request id goes along in ``X-Request-Id``.

    Hooks run in the task that sends, so the id is the one of the request being served."""
    request_id = REQUEST_ID.get()
    if request_id and REQUEST_ID_HEADER not in request.headers:
        request.headers[REQUEST_ID_HEADER] = request_id
