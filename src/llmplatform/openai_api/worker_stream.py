"""The gateway's hot path to the workers: ``POST /worker_generate_stream`` over aiohttp.

Every request the gateway serves is one of these streams, so their cost per request is the
gateway's added latency. On a 2-core CPU, httpx (pure-Python HTTP/1.1 through h11 and httpcore)
took 1.8 ms more per request than aiohttp (C parser) against a worker that answers at once, and
3.0 ms more against the real worker (medians of paired, interleaved requests through two
gateways). The other, rare calls (controller, model details, aborts) stay on the app's httpx
client.

Failures map to the same typed errors as httpx's (``worker_wire.transport_errors``): no
connection in time or refused/reset before an answer is :class:`WorkerUnavailableError` (another
worker may take the request), a worker silent for ``worker_timeout`` between two reads is
:class:`~llmplatform.errors.WorkerTimeoutError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp

from llmplatform.errors import WorkerTimeoutError
from llmplatform.openai_api.worker_wire import WorkerUnavailableError, worker_http_error
from llmplatform.utils.request_id import REQUEST_ID, REQUEST_ID_HEADER

_JSON = {"Content-Type": "application/json"}


class WorkerStreamClient:
    """One pooled aiohttp session for the app's worker streams (create it inside the app's
    event loop; ``aclose`` it at shutdown)."""

    def __init__(self, *, headers: Mapping[str, str], connect_timeout: float, read_timeout: float,
                 max_connections: int) -> None:
        self._headers = {**_JSON, **headers}
        self._read_timeout = read_timeout
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=15.0),
            # sock_read: at most this long between two reads (the worker's silence), as httpx's
            # read timeout; no limit on the whole stream, which may run for minutes.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout,
                                          connect=connect_timeout, sock_read=read_timeout),
            auto_decompress=False, trust_env=False, skip_auto_headers=("User-Agent",))

    async def aclose(self) -> None:
        await self._session.close()

    @contextlib.asynccontextmanager
    async def stream(self, url: str, payload: Mapping[str, Any]) -> AsyncIterator[AsyncIterator[bytes]]:
        """The worker's response body, as it arrives; a non-200 answer raises its typed error.
        Leaving the block before the end closes the connection (the worker sees the client go
        and aborts the request); reading to the end returns it to the pool."""
        headers = self._headers
        request_id = REQUEST_ID.get()
        if request_id:
            headers = {**headers, REQUEST_ID_HEADER: request_id}
        with _transport_errors(url, self._read_timeout):
            async with self._session.post(url, data=json.dumps(dict(payload)).encode(),
                                          headers=headers) as response:
                if response.status != 200:
                    body = await response.read()
                    raise worker_http_error(response.status, response.headers, body,
                                            f"The worker at {url}")
                complete = False
                try:
                    yield _body(response, url, self._read_timeout)
                    complete = response.content.at_eof()
                finally:
                    if not complete:
                        response.close()  # not reusable mid-body: drop the connection


async def _body(response: aiohttp.ClientResponse, url: str, read_timeout: float) -> AsyncIterator[bytes]:
    with _transport_errors(url, read_timeout):
        async for data in response.content.iter_any():
            yield data


@contextlib.contextmanager
def _transport_errors(url: str, timeout: float) -> Iterator[None]:
    try:
        yield
    except aiohttp.ConnectionTimeoutError:
        raise WorkerUnavailableError(f"The worker at {url} did not accept a connection in time.") from None
    except (aiohttp.SocketTimeoutError, asyncio.TimeoutError):
        raise WorkerTimeoutError(f"The worker at {url} did not answer within {timeout:g} s.") from None
    except aiohttp.ClientError as exc:
        # Refused, reset, or closed before any answer: the worker is gone (or going).
        raise WorkerUnavailableError(f"The worker at {url} is unreachable ({type(exc).__name__}).") from None
