"""API-key check for the /v1 routes."""

from __future__ import annotations

import hmac

from fastapi import Request

from llmplatform.openai_api.errors import AuthenticationError


async def require_api_key(request: Request) -> None:
    """A FastAPI dependency: with keys configured, `Authorization: Bearer <key>` must match one.

    Every key is compared, in constant time, so the answer's timing says nothing about which
    key (or how much of one) matched.
    """
    keys: tuple[str, ...] = request.app.state.settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError(
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
    presented = token.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    if not matched:
        raise AuthenticationError("Incorrect API key provided.")
