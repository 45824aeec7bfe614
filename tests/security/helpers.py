"""Witnesses for "never dialled": an httpx transport that records every request a server makes,
and a TCP listener on 127.0.0.1 that counts the connections it is offered."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

import httpx


def _is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address in any numeric spelling the C library reads (or
    `localhost`); names are not resolved here."""
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes requests to a real transport and records them. Only loopback is dialled: a request
    for any other host is recorded and fails as a refused connection would, so a test can
    register an address such as 10.9.8.7 without sending traffic off the machine."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not _is_loopback(request.url.host):
            raise httpx.ConnectError(f"test transport: {request.url.host} is not dialled", request=request)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def urls(self) -> list[str]:
        return [str(r.url) for r in self.requests]


class ConnectionCounter:
    """A listening socket on 127.0.0.1 that accepts, counts and closes connections."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-counter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.count += 1
            conn.close()

    def settled_count(self, wait: float = 0.1) -> int:
        """The count after a short wait, so a connection attempt in flight is not missed (the
        servers under test dial before they answer, so a refusal already came after any dial)."""
        time.sleep(wait)
        return self.count

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> ConnectionCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
