"""The cluster's shared secret: one header on every call between controller, workers and gateway.

When a cluster is given a secret (``--cluster-secret`` or ``LLMPLATFORM_CLUSTER_SECRET``), every
request between its services carries it in ``X-LLMPlatform-Secret``, and every service refuses a
request without it (401) before reading the body or calling anyone else. That is what keeps a
stranger from registering a rogue worker (which would receive prompts) or from making the
controller dial an address of their choice.

Secrets are compared as SHA-256 digests with :func:`hmac.compare_digest`: equal-length inputs, so
neither the comparison's timing nor an early exit on length says anything about the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("llmplatform.security")

SECRET_HEADER = "X-LLMPlatform-Secret"
SECRET_ENV = "LLMPLATFORM_CLUSTER_SECRET"
_SECRET_HEADER_KEY = SECRET_HEADER.lower().encode("latin-1")
# FastChat's "invalid auth key" code, so a FastChat-style peer reads the refusal as an auth error.
_INVALID_AUTH_KEY = 40101


def secret_from_env(flag_value: str | None) -> str | None:
    """The secret from a flag, else from ``LLMPLATFORM_CLUSTER_SECRET``; None when neither (or
    only whitespace) is given."""
    value = flag_value if flag_value is not None else os.environ.get(SECRET_ENV)
    value = (value or "").strip()
    return value or None


def secret_headers(secret: str | None) -> dict[str, str]:
    """Headers an outgoing call inside the cluster carries (none without a secret)."""
    return {SECRET_HEADER: secret} if secret else {}


def digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value).digest()


def secret_matches(presented: str | bytes | None, expected_digest: bytes) -> bool:
    """Constant-time check of a presented secret against the digest of the real one. A missing
    secret is hashed and compared like any other, so it costs what a wrong one does."""
    matched = hmac.compare_digest(digest(presented or b""), expected_digest)
    return matched and presented is not None


class ClusterSecretMiddleware:
    """Refuses (401) every HTTP request without the cluster secret, except ``exempt_paths``.

    A pure ASGI middleware, so the refusal happens before any route runs: the body is never read
    and no outbound call (a status poll of an announced worker, a proxied stream) can be made.
    The path is the request's own ``scope["path"]``, compared exactly; anything not listed is
    protected.
    """

    def __init__(self, app: ASGIApp, *, secret: str, exempt_paths: Iterable[str] = ("/health",)) -> None:
        if not secret:
            raise ValueError("ClusterSecretMiddleware needs a non-empty secret")
        self.app = app
        self._digest = digest(secret)
        self._exempt = frozenset(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._exempt:
            await self.app(scope, receive, send)
            return
        presented = None
        for key, value in scope.get("headers", ()):
            if key == _SECRET_HEADER_KEY:
                presented = value
                break
        if secret_matches(presented, self._digest):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        logger.warning("refused %s %s from %s: missing or wrong %s", scope.get("method"), scope["path"],
                       client[0] if client else "?", SECRET_HEADER)
        message = f"this cluster requires its shared secret in the {SECRET_HEADER} header"
        # Both shapes at once: FastChat's {"text", "error_code"} and the controller's {"error"}.
        body = json.dumps({"error": message, "text": message, "error_code": _INVALID_AUTH_KEY}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
