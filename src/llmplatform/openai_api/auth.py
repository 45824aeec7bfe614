"""API keys: `ApiKeyMiddleware` guards every path, `require_admin_key` the /v1/admin routes.

The middleware decides on the request's own path (`scope["path"]`, what the router will match),
never on a URL rebuilt from headers, and denies by default: with keys configured, every path but
the public ones (`/health`, `/metrics`) needs a key, including paths no route serves. So
`//v1/models`, `/V1/models` or `/v1/%2e%2e/v1/models` cannot reach a route without a key, and an
unknown path without a key is a 401, not a 404 that confirms what exists.

Keys are compared in constant time, against every configured key (`utils.api_keys.KeySet`).
"""

from __future__ import annotations

import json

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from llmplatform.openai_api.errors import AuthenticationError, PermissionDeniedError, error_payload
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.api_keys import KeySet

PUBLIC_PATHS = frozenset({"/health", "/metrics"})
"""Paths answered without a key: liveness for load balancers and scrapes for monitoring."""

_MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


BATCH_OWNER_SCOPE_KEY = "llmplatform.batch_owner"
"""The ASGI scope key that marks a request as one line of a batch, run in-process by the batch
runner (openai_api.batch_runner) for the tenant named there (who created the batch). Only the
runner's own transport sets it: a request from the network arrives with uvicorn's scope, whose
keys no client chooses, so no header or body can make a request pass for a batch line. Such a
request skips the key check (its owner was checked when the batch was created, and its key is
never stored) and counts against its owner's limits (openai_api.tenants)."""


def batch_owner(scope: Scope) -> str | None:
    """The tenant a batch line runs for; None for every other request."""
    return scope.get(BATCH_OWNER_SCOPE_KEY)


MESSAGES_PATH = "/v1/messages"
"""Anthropic's Messages routes (this path and below): its clients send the key as `x-api-key`."""


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def presented_key(headers: Headers, path: str) -> str:
    """The bearer token of `Authorization: Bearer <key>` (the scheme is case-insensitive, as
    RFC 7235 says; the key is not); on the Messages routes (`path`), also Anthropic's
    `x-api-key: <key>`, as its clients send it. Any other scheme, or none, is a missing key."""
    if is_messages_path(path) and "authorization" not in headers and headers.get("x-api-key", "").strip():
        return headers["x-api-key"].strip()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError(_MISSING_KEY)
    return token


class ApiKeyMiddleware:
    """Refuses (401, OpenAI's envelope) every HTTP request outside `PUBLIC_PATHS` whose bearer
    key is not one of `keys`, before any route (or body read) runs."""

    def __init__(self, app: ASGIApp, *, keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = KeySet(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self._keys or scope["path"] in PUBLIC_PATHS
                or batch_owner(scope) is not None):
            await self.app(scope, receive, send)
            return
        try:
            if not self._keys.matches(presented_key(Headers(scope=scope), scope["path"])):
                raise AuthenticationError("Incorrect API key provided.")
        except AuthenticationError as exc:
            await _send_401(send, exc)
            return
        await self.app(scope, receive, send)


async def _send_401(send: Send, exc: AuthenticationError) -> None:
    body = json.dumps(error_payload(exc)).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})


async def require_api_key(request: Request) -> None:
    """A FastAPI dependency on /v1 (behind the middleware too, so a route mounted elsewhere by
    mistake is still guarded): the key must be an API key or an admin key."""
    settings: GatewaySettings = request.app.state.settings
    if not settings.api_keys or batch_owner(request.scope) is not None:
        return
    token = presented_key(request.headers, request.scope["path"])
    if not KeySet(settings.api_keys + settings.admin_api_keys).matches(token):
        raise AuthenticationError("Incorrect API key provided.")


async def require_admin_key(request: Request) -> None:
    """A FastAPI dependency for admin routes: the key must be an admin key (`admin_api_keys`, or
    any of `api_keys` when no admin keys are configured); open when no keys are configured. A
    valid non-admin key is 403, a missing or unknown one 401."""
    settings: GatewaySettings = request.app.state.settings
    admin_keys = settings.admin_api_keys or settings.api_keys
    if not admin_keys:
        return
    token = presented_key(request.headers, request.scope["path"])
    if KeySet(admin_keys).matches(token):
        return
    if KeySet(settings.api_keys).matches(token):
        raise PermissionDeniedError("This API key may not use the admin routes.")
    raise AuthenticationError("Incorrect API key provided.")
