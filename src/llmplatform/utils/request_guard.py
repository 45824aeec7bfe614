"""What a controller or worker accepts before any route runs: who may call it, and what body.

The controller and the workers speak a JSON protocol to programs, never to browsers. Yet a
browser can still reach them: any page the operator opens can post a form (``text/plain``, no
preflight) to ``http://127.0.0.1:21001/register_worker``, and a page whose name is rebound to
127.0.0.1 (DNS rebinding) can even read the answers. :class:`RequestGuard`, one pure ASGI
middleware installed by each app factory, closes both, and caps what a body may cost:

- **Host**: with ``allowed_hosts`` set (a service bound to loopback sets it to the names loopback
  answers to, :func:`allowed_hosts_for`), a request whose ``Host`` names anything else is a 400.
  A rebound page sends its own name (``Host: evil.example``), so it never gets an answer. No
  ``Host`` at all (HTTP/1.0) is let through: browsers always send one.
- **Origin**: a browser says which page a request comes from (``Origin``) on every cross-origin
  POST, form posts included. One that is not the service's own origin (same host and port as the
  ``Host`` the request was sent to) is a 403. Programs send no ``Origin`` and pass.
- **Content-Type**: a body must be JSON (``application/json`` or ``*/*+json``); anything else,
  a form or plain text included, is a 415. A POST without a body and without a type passes:
  FastChat's clients post to argument-less routes (``/list_models``, ``/worker_get_status``)
  exactly so. A body without a type is a 415 too (a browser's ``Blob`` body has none).
- **Size**: a declared ``Content-Length`` over ``max_body_bytes`` is a 413 before a byte of the
  body is read; a body without one (chunked) is read message by message and refused as soon as
  the running total passes the cap, so an oversized body is never held whole.

Starlette's ``TrustedHostMiddleware`` does the Host part, but splits the header at its first
colon (so ``[::1]:21001`` never matches) and answers in plain text; the check here is the dozen
lines it needs, answering in the service's own error shape (``render``).

Refusals carry ``Connection: close``: the rest of the body is left unread, so the connection
cannot carry another request.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.errors import ErrorCode, InvalidRequestError, LLMPlatformError, PayloadTooLargeError

logger = logging.getLogger("llmplatform.security")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
"""The controller's and workers' body cap: four times the gateway's 4 MiB, because the params
dict a gateway sends for a 4 MiB request can be bigger than the request (its prompt rendered by
the chat template, non-ASCII text escaped as ``\\uXXXX``)."""

LOOPBACK_HOST_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})
"""The names a service bound to loopback answers to (any port)."""

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class HostNotAllowedError(LLMPlatformError):
    """The request names a host this service does not answer to (HTTP 400): DNS rebinding."""

    error_code = ErrorCode.VALIDATION_TYPE_ERROR
    http_status = 400
    openai_type = "invalid_request_error"


class CrossOriginError(LLMPlatformError):
    """A browser request from another site's page (HTTP 403)."""

    error_code = ErrorCode.INVALID_AUTH_KEY
    http_status = 403
    openai_type = "invalid_request_error"


class UnsupportedMediaTypeError(LLMPlatformError):
    """A request body that is not JSON (HTTP 415)."""

    error_code = ErrorCode.VALIDATION_TYPE_ERROR
    http_status = 415
    openai_type = "invalid_request_error"


def cluster_error_body(exc: LLMPlatformError) -> bytes:
    """The controller's ``{"error"}`` and FastChat's ``{"text", "error_code"}`` at once, as
    every refusal of a cluster service is shaped (see ``cluster_secret``)."""
    return json.dumps({"error": exc.message, "text": exc.message, "error_code": exc.error_code}).encode()


@dataclass(frozen=True)
class RequestGuardConfig:
    """What :class:`RequestGuard` lets through; each check can be switched off on its own."""

    allowed_hosts: frozenset[str] | None = None
    """Host names (lower case, without port; IPv6 literals in brackets) a request may name in its
    ``Host`` header; None: any. A service's ``__main__`` sets it from its bind address
    (:func:`allowed_hosts_for`); an app built without being told stays unchecked."""
    same_origin_only: bool = True
    """Refuse (403) a request whose ``Origin`` is not the host it was sent to."""
    json_bodies_only: bool = True
    """Refuse (415) a body that is not declared JSON."""
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    """Largest request body; None: no cap."""
    render: Callable[[LLMPlatformError], bytes] = cluster_error_body
    """The JSON body of a refusal."""

    def __post_init__(self) -> None:
        if self.allowed_hosts is not None:
            object.__setattr__(self, "allowed_hosts", frozenset(_normal_host(h) for h in self.allowed_hosts))
        size = self.max_body_bytes
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"max_body_bytes must be a positive integer or None, got {size!r}")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``: a bind address only this machine can reach."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The ``allowed_hosts`` of a service bound to ``bind_host``: the loopback names (and the bind
    address itself) when bound to loopback, plus ``extra``; elsewhere only ``extra``, and None (no
    check) when there is none. A ``*`` in ``extra`` turns the check off."""
    names = {name.strip() for name in extra if name.strip()}
    if "*" in names:
        return None
    if is_loopback(bind_host):
        names |= LOOPBACK_HOST_NAMES | {bind_host}
    return frozenset(_normal_host(n) for n in names) if names else None


def guard_config(host: str, allowed_hosts: Iterable[str], *, max_body_bytes: int | None,
                 own_names: Iterable[str | None] = ()) -> RequestGuardConfig:
    """The guard of a service bound to ``host`` that also lets ``allowed_hosts`` through (see
    :func:`allowed_hosts_for`). ``own_names`` (the host of the address a worker announces) are
    allowed too whenever Host is checked at all."""
    allowed = allowed_hosts_for(host, allowed_hosts)
    if allowed is not None:
        allowed |= {_normal_host(name) for name in own_names if name}
    return RequestGuardConfig(allowed_hosts=allowed, max_body_bytes=max_body_bytes)


class RequestGuard:
    """The checks of the module doc, in that order, before the wrapped app sees the request."""

    def __init__(self, app: ASGIApp, *, config: RequestGuardConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self._check_caller(scope, headers)
            if scope["method"] not in _BODY_METHODS:
                await self.app(scope, receive, send)
                return
            content_type = self._check_body_headers(headers)
            body = await read_body_bounded(receive, self.config.max_body_bytes)
            if body is None:  # the client left while sending; nobody is waiting for an answer
                return
            if body and content_type is None and self.config.json_bodies_only:
                raise _not_json("none")
        except LLMPlatformError as exc:
            await send_refusal(send, exc.http_status, self.config.render(exc))
            return
        await self.app(scope, replay(body, receive), send)

    def _check_caller(self, scope: Scope, headers: Headers) -> None:
        host = headers.get("host")
        check_host(scope, host, self.config.allowed_hosts)
        origin = headers.get("origin")
        if self.config.same_origin_only and origin is not None and not _same_origin(origin, host):
            _log_refusal(scope, f"Origin {origin[:80]!r}")
            raise CrossOriginError("Requests from web pages of other origins are refused.")

    def _check_body_headers(self, headers: Headers) -> str | None:
        content_type = headers.get("content-type")
        if content_type is not None and self.config.json_bodies_only and not is_json_media_type(content_type):
            raise _not_json(repr(content_type[:80]))
        declared = headers.get("content-length")
        cap = self.config.max_body_bytes
        if declared is not None and cap is not None:
            try:
                length = int(declared)
            except ValueError:
                length = -1
            if length < 0:
                raise InvalidRequestError(f"Invalid Content-Length header: {declared[:40]!r}.")
            if length > cap:
                raise PayloadTooLargeError.over(cap)
        return content_type


def check_host(scope: Scope, host: str | None, allowed: frozenset[str] | None) -> None:
    """Raises :class:`HostNotAllowedError` (and logs it) when ``host`` (a ``Host`` header, None
    when absent) names a host outside ``allowed`` (None: any). Shared with the web UI's guard."""
    if allowed is not None and host is not None and _host_name(host) not in allowed:
        _log_refusal(scope, f"Host {host[:80]!r}")
        raise HostNotAllowedError(f"This service does not answer to the host {host[:80]!r}.")


def is_json_media_type(content_type: str) -> bool:
    """`application/json`, optionally with parameters (`; charset=utf-8`), or any `+json` type."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


async def read_body_bounded(receive: Receive, max_bytes: int | None) -> bytes | None:
    """The whole request body, refused (:class:`PayloadTooLargeError`) as soon as the running
    total passes ``max_bytes`` (None: no cap); None if the client disconnected first."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise PayloadTooLargeError.over(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` as one message, then passes on to ``receive``
    (the client's disconnect, which streaming routes wait for)."""
    replayed = False

    async def receive_again() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


async def send_refusal(send: Send, status: int, body: bytes,
                       extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A complete JSON answer that closes the connection (the request body may be unread)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def _not_json(content_type: str) -> UnsupportedMediaTypeError:
    return UnsupportedMediaTypeError(
        f"Unsupported Content-Type {content_type}; a request body must be JSON "
        "(Content-Type: application/json)."
    )


def _normal_host(name: str) -> str:
    """Lower case, no trailing dot, IPv6 literals in brackets: how allowed names are kept."""
    name = name.strip().lower().rstrip(".")
    if ":" in name and not name.startswith("["):
        return f"[{name}]"
    return name


def _host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:21001`` -> ``[::1]``."""
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    name, _, port = value.rpartition(":")
    return (name if name and port.isdigit() else value).rstrip(".")


def _same_origin(origin: str, host: str | None) -> bool:
    """``Origin`` names the same host and port the request was sent to (its ``Host``)."""
    if host is None:
        return False
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed frames, file: pages) and anything malformed
    return parts.netloc.lower() == host.strip().lower()


def _log_refusal(scope: Scope, what: str) -> None:
    client = scope.get("client")
    logger.warning("refused %s %s from %s: %s", scope.get("method"), scope.get("path"),
                   client[0] if client else "?", what)
