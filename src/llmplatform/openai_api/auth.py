"""API-key checks: `require_api_key` for the /v1 routes, `require_admin_key` for /v1/admin."""

from __future__ import annotations

import hmac

from fastapi import Request

from llmplatform.openai_api.errors import AuthenticationError, PermissionDeniedError
from llmplatform.openai_api.settings import GatewaySettings


def _presented_key(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError(
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    return token


def _matches(token: str, keys: tuple[str, ...]) -> bool:
    """Every key is compared, in constant time, so the answer's timing says nothing about which
    key (or how much of one) matched."""
    presented = token.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched


async def require_api_key(request: Request) -> None:
    """A FastAPI dependency: with `api_keys` configured, `Authorization: Bearer <key>` must match
    one of them or of the admin keys."""
    settings: GatewaySettings = request.app.state.settings
    if not settings.api_keys:
        return
    if not _matches(_presented_key(request), settings.api_keys + settings.admin_api_keys):
        raise AuthenticationError("Incorrect API key provided.")


async def require_admin_key(request: Request) -> None:
    """A FastAPI dependency for admin routes: the key must be an admin key (`admin_api_keys`, or
    any of `api_keys` when no admin keys are configured); open when no keys are configured. A
    valid non-admin key is 403, a missing or unknown one 401."""
    settings: GatewaySettings = request.app.state.settings
    admin_keys = settings.admin_api_keys or settings.api_keys
    if not admin_keys:
        return
    token = _presented_key(request)
    if _matches(token, admin_keys):
        return
    if _matches(token, settings.api_keys):
        raise PermissionDeniedError("This API key may not use the admin routes.")
    raise AuthenticationError("Incorrect API key provided.")
