"""The gateway's hot path to the workers: ``POST /worker_generate_stream`` (and
``/worker_get_embeddings``) on pooled connections.

Every request the gateway serves is one of these calls, so their cost is the gateway's added
latency. This is a small HTTP/1.1 client made for exactly this exchange: one pooled keep-alive
connection per stream, the request written in one call (head and JSON body), the answer parsed
by httptools (the C parser uvicorn already uses) as it arrives, chunked bodies decoded there
(one connection's exchange: ``worker_connection``; this module is the pool and the dial).
It replaced an aiohttp session (whose general client builds every request through URL, cookie,
header and tracing machinery; aiohttp itself had replaced httpx's pure-Python HTTP/1.1, 1.8 ms
per request less). With the same change's smaller cuts (the streamed answer's headers go out with
its first event; one prompt is not wrapped in a task; chunks parsed in one pass), on a 2-core CPU:
the gateway's CPU per request 1.86 -> 1.45 ms and 0.38 ms less time to first token against a
worker that answers at once (1,500 interleaved pairs), and 0.5-1.2 ms less added latency against
the real worker (three runs of 40-60 interleaved requests, the method of benchmarks/serve_gateway.py).
The other, rare calls (controller, model details, aborts) stay on the app's httpx client.
Embeddings calls came here later: at 64 requests in flight, httpx's pool spent ~45% of the
gateway's CPU checking its connections (benchmarks/embeddings.py).

Connections. A connection goes back to the pool only when its answer was read to the end and
both sides keep it alive; otherwise it is closed (leaving a stream early closes it, which tells
the worker to abort the request). Idle connections are kept for ``IDLE_TIMEOUT_S``, under
uvicorn's default keep-alive (5 s), so the pool rarely hands out one the worker is closing; when
that race is lost anyway (a reused connection closed before any byte of the answer), the request
is sent once more on a new connection: the worker never saw it.

Failures map to the same typed errors as the httpx calls (``worker_wire.transport_errors``): no
connection in time, or refused/reset/closed before an answer, is :class:`WorkerUnavailableError`
(another worker may take the request); a worker silent for ``read_timeout`` between two reads is
:class:`~llmplatform.errors.WorkerTimeoutError`; a non-200 answer is
:func:`~llmplatform.openai_api.worker_wire.worker_http_error`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from llmplatform.errors import WorkerTimeoutError
from llmplatform.openai_api.worker_connection import ConnectionGone, WorkerConnection
from llmplatform.openai_api.worker_wire import WorkerUnavailableError, worker_http_error
from llmplatform.utils.request_id import REQUEST_ID, REQUEST_ID_HEADER
from llmplatform.utils.worker_addresses import (DialRefused, IPNetwork, Resolver, addresses_to_dial,
                                               resolve_host)

IDLE_TIMEOUT_S = 4.0
"""How long an idle pooled connection is kept (below uvicorn's 5 s keep-alive)."""
MAX_IDLE_PER_HOST = 64
"""Idle connections kept per worker; more are closed when they come back."""


class _Target:
    """A worker URL split once: where to connect and what to put in the request line."""

    __slots__ = ("key", "host", "port", "ssl", "path", "host_header")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:  # a port out of range or not a number
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise WorkerUnavailableError(f"The worker address {url!r} is not an http(s) URL.")
        self.host = parts.hostname
        self.port = port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.key = (parts.scheme, self.host, self.port)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.host_header = parts.netloc.rsplit("@", 1)[-1]


class WorkerBody:
    """A 200 answer being read: its ``headers`` (names lower-cased) and its body, iterated with
    ``async for`` as it arrives."""

    def __init__(self, headers: Mapping[str, str], chunks: AsyncIterator[bytes]) -> None:
        self.headers = headers
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks


class WorkerStreamClient:
    """The pool of connections for the app's worker streams (create it inside the app's event
    loop; ``aclose`` it at shutdown)."""

    def __init__(self, *, headers: Mapping[str, str], connect_timeout: float, read_timeout: float,
                 max_connections: int, allowed_networks: tuple[IPNetwork, ...] = (),
                 resolve: Resolver | None = None) -> None:
        for name, value in headers.items():
            if any(c in f"{name}{value}" for c in "\r\n\0"):
                raise ValueError(f"header {name!r} has a line break or NUL in it")
        self._extra_headers = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._allowed_networks = allowed_networks
        self._resolve = resolve or (lambda host: resolve_host(host, connect_timeout))
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple[str, str, int], list[WorkerConnection]] = {}
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = _Target(url)
            if len(self._targets) >= 4096:
                self._targets.clear()
            self._targets[url] = target
        return target

    def _pooled(self, target: _Target) -> WorkerConnection | None:
        connections = self._idle.get(target.key)
        now = time.monotonic()
        while connections:
            connection = connections.pop()
            if not connection.closed and now - connection.idle_since < IDLE_TIMEOUT_S:
                return connection
            connection.close()
        return None

    def _release(self, target: _Target, connection: WorkerConnection) -> None:
        if self._closed or not connection.reusable():
            connection.close()
            return
        connections = self._idle.setdefault(target.key, [])
        now = time.monotonic()
        # Reused last in, first out: after a burst, the connections it no longer needs age out.
        connections[:] = [c for c in connections if not c.closed and now - c.idle_since < IDLE_TIMEOUT_S]
        if len(connections) >= MAX_IDLE_PER_HOST:
            connection.close()
            return
        connection.idle_since = now
        connections.append(connection)

    async def _connect(self, target: _Target, url: str) -> WorkerConnection:
        loop = asyncio.get_running_loop()
        context = None
        if target.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout):
                # A name is resolved here, once, and checked; the address checked is the one
                # dialled (the Host header and TLS's server name stay the name's).
                addresses = await addresses_to_dial(target.host, self._resolve,
                                                    self._allowed_networks, self._connect_timeout)
                _, connection = await loop.create_connection(
                    lambda: WorkerConnection(loop), addresses[0], target.port, ssl=context,
                    server_hostname=target.host if context is not None else None)
        except DialRefused as exc:
            raise WorkerUnavailableError(f"The worker at {url} was not dialled: {exc}.") from None
        except TimeoutError:
            raise WorkerUnavailableError(f"The worker at {url} did not accept a connection in time.") from None
        except OSError as exc:
            raise WorkerUnavailableError(f"The worker at {url} is unreachable ({type(exc).__name__}).") from None
        return connection

    def _request(self, target: _Target, payload: Mapping[str, Any]) -> bytes:
        body = json.dumps(dict(payload)).encode()
        request_id = REQUEST_ID.get()
        trace = f"{REQUEST_ID_HEADER}: {request_id}\r\n" if request_id else ""
        head = (f"POST {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"{self._extra_headers}{trace}\r\n")
        return head.encode("latin-1") + body

    async def _open(self, target: _Target, url: str, request: bytes) -> WorkerConnection:
        """A connection whose answer's status and headers have arrived."""
        connection = self._pooled(target)
        reused = connection is not None
        if connection is None:
            connection = await self._connect(target, url)
        try:
            connection.send(request)
            await connection.wait_headers(self._read_timeout)
            return connection
        except ConnectionGone as exc:
            connection.close()
            if reused and exc.before_answer:  # the worker closed an idle connection: it never saw this
                return await self._open(target, url, request)
            raise WorkerUnavailableError(f"The worker at {url} is unreachable ({exc.reason}).") from None
        except asyncio.TimeoutError:
            connection.close()
            raise WorkerTimeoutError(f"The worker at {url} did not answer within {self._read_timeout:g} s.") from None
        except BaseException:
            connection.close()
            raise

    @contextlib.asynccontextmanager
    async def stream(self, url: str, payload: Mapping[str, Any]) -> AsyncIterator[WorkerBody]:
        """The worker's response (headers, then the body as it arrives: ``async for``); a
        non-200 answer raises its typed error.
        Leaving the block before the end closes the connection (the worker sees the client go
        and aborts the request); reading to the end returns it to the pool."""
        if self._closed:
            raise WorkerUnavailableError("The gateway is shutting down.")
        target = self._target(url)
        request = self._request(target, payload)
        async with self._slots:
            connection = await self._open(target, url, request)
            try:
                if connection.status != 200:
                    body = await self._read_all(connection, url)
                    raise worker_http_error(connection.status, connection.headers, body, f"The worker at {url}")
                yield WorkerBody(connection.headers, self._body(connection, url))
            finally:
                self._release(target, connection)

    async def _read_all(self, connection: WorkerConnection, url: str) -> bytes:
        try:
            return await connection.read_all(self._read_timeout)
        except ConnectionGone as exc:
            raise WorkerUnavailableError(f"The worker at {url} is unreachable ({exc.reason}).") from None
        except asyncio.TimeoutError:
            raise WorkerTimeoutError(f"The worker at {url} did not answer within {self._read_timeout:g} s.") from None

    async def _body(self, connection: WorkerConnection, url: str) -> AsyncIterator[bytes]:
        while True:
            try:
                data = await connection.read_some(self._read_timeout)
            except ConnectionGone as exc:
                raise WorkerUnavailableError(f"The worker at {url} is unreachable ({exc.reason}).") from None
            except asyncio.TimeoutError:
                raise WorkerTimeoutError(
                    f"The worker at {url} did not answer within {self._read_timeout:g} s.") from None
            if data is None:
                return
            yield data
