"""What every answer of the web UI passes through: the Host check, and headers that keep the
page from being framed, from running scripts it did not ship, and from fetching what it shows.

`PageGuard` is one pure ASGI middleware around the whole app (Gradio's page, `/gradio_api/*`,
its SSE streams, websockets, static files and `/health`):

- **Host** (DNS rebinding): with `allowed_hosts` set, a request whose `Host` names anything else
  is a 400 before any route runs, the check the controller, workers and gateway make
  (`utils.request_guard.check_host`); a websocket handshake is closed instead (uvicorn answers
  it 403). A rebound page sends its own name, so it never reads the cluster table nor drives the
  chat with the UI's gateway key.
- **Framing** (clickjacking): `frame-ancestors 'none'` and, for browsers without CSP level 2,
  `X-Frame-Options: DENY`.
- **Scripts**: `script-src 'self' 'nonce-N'` with a fresh N per response. Gradio's page has five
  inline `<script>`s (its config among them, different per page), so neither `'self'` alone nor
  hashes fit; each HTML answer gets the nonce written into its own `<script` tags here. Nothing
  else inline runs: not an injected `<script>`, an `on*=` attribute nor a `javascript:` URL.
  Measured in headless Chromium (tests/browser/test_webui_csp.py): no CSP violation while the
  page loads and chats; Gradio's bundles need no `eval`.
- **Fetches**: images, media and frames from the page's own origin only, no DNS prefetching of
  links, no Referer (see `app`'s module doc for why).
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.utils.request_guard import HostNotAllowedError, check_host, send_refusal

_FIXED_POLICY = (
    # Whatever a page shows, the browser loads images, media, frames and plugins only from the
    # UI itself (and inline data), so a way through the server's sanitising still fetches nothing.
    "img-src 'self' data: blob:; media-src 'self' data: blob:; frame-src 'self'; "
    "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)

FIXED_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-frame-options", b"DENY"),
    (b"x-dns-prefetch-control", b"off"),    # links in answers are not looked up before a click
    (b"referrer-policy", b"no-referrer"),   # nor does a click tell the target where it came from
    (b"x-content-type-options", b"nosniff"),
)

MAX_HTML_BYTES = 8 * 1024 * 1024
"""Largest HTML answer the nonce is written into (Gradio's page, its config inline, is about
400 KB); a bigger one is passed on unchanged, its inline scripts then blocked: a broken page
rather than an open one."""

_SCRIPT_TAG = re.compile(rb"<script(?=[\s>])", re.IGNORECASE)


def content_security_policy(nonce: str) -> bytes:
    return f"{_FIXED_POLICY}; script-src 'self' 'nonce-{nonce}'".encode()


def add_nonce(html: bytes, nonce: str) -> bytes:
    """Every `<script` tag of `html` carries `nonce`. Model text never reaches here unescaped
    (it arrives later, over the API, as data), so only the page's own tags are tagged."""
    return _SCRIPT_TAG.sub(b'<script nonce="' + nonce.encode() + b'"', html)


class PageGuard:
    """The checks and headers of the module doc, around `app`."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: frozenset[str] | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            check_host(scope, Headers(scope=scope).get("host"), self.allowed_hosts)
        except HostNotAllowedError as exc:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # policy violation
            else:
                await send_refusal(send, exc.http_status, json.dumps({"error": exc.message}).encode())
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _Headed(send))


class _Headed:
    """A `send` that adds the headers; an HTML body is held until whole, to tag its scripts."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._nonce = base64.b64encode(secrets.token_bytes(16)).decode()
        self._start: Message | None = None
        self._held: list[bytes] = []
        self._held_bytes = 0

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            names = {name.lower() for name, _ in headers}
            headers += [(n, v) for n, v in FIXED_HEADERS if n not in names]
            if b"content-security-policy" not in names:
                headers.append((b"content-security-policy", content_security_policy(self._nonce)))
            message = {**message, "headers": headers}
            if _is_html(headers):
                self._start = message
                return
        elif message["type"] == "http.response.body" and self._start is not None:
            self._held.append(message.get("body", b""))
            self._held_bytes += len(self._held[-1])
            if message.get("more_body", False):
                if self._held_bytes <= MAX_HTML_BYTES:
                    return
                await self._flush(b"".join(self._held), more_body=True, tagged=False)
                return
            body = b"".join(self._held)
            tagged = self._held_bytes <= MAX_HTML_BYTES
            await self._flush(add_nonce(body, self._nonce) if tagged else body, more_body=False,
                              tagged=tagged)
            return
        await self._send(message)

    async def _flush(self, body: bytes, *, more_body: bool, tagged: bool) -> None:
        start, self._start, self._held = self._start, None, []
        assert start is not None
        if tagged:  # the body grew by the nonces
            start = {**start, "headers": _with_length(start["headers"], len(body))}
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": more_body})


def _is_html(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """An uncompressed HTML body (a compressed one, Gradio's Brotli of a `.html` file, is passed
    on as it is: its inline scripts do not run, which is the safe side)."""
    found = dict((name.lower(), value) for name, value in headers)
    media_type = found.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return media_type == b"text/html" and b"content-encoding" not in found


def _with_length(headers: Iterable[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(n, v) for n, v in headers if n.lower() != b"content-length"]
    return kept + [(b"content-length", str(length).encode())]
