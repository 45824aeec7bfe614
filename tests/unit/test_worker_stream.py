"""The gateway's worker-stream client (openai_api/worker_stream.py) against a scripted HTTP server
on 127.0.0.1: keep-alive reuse, the idle-close race, early exits, errors and timeouts."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from llmplatform.errors import EngineOverloadedError, WorkerTimeoutError
from llmplatform.openai_api import worker_connection
from llmplatform.openai_api.worker_stream import WorkerStreamClient
from llmplatform.openai_api.worker_wire import WorkerUnavailableError
from llmplatform.utils.request_id import REQUEST_ID

Reply = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[bool]]
"""Answers one request; returns whether to keep the connection for another."""


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"


async def stream_two(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
    writer.write(OK_HEAD)
    writer.write(chunked(b'{"text":"a"}\0', b'{"text":"ab"}\0'))
    await writer.drain()
    return True


class Server:
    """One request per exchange, answered by `reply`; records requests and connections."""

    def __init__(self, reply: Reply, *, ssl_context: ssl.SSLContext | None = None) -> None:
        self.reply = reply
        self.ssl_context = ssl_context
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.closed_by_client = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = {"line": lines[0], "headers": headers, "json": json.loads(body) if body else None,
                           "reader": reader}
                self.requests.append(request)
                if not await self.reply(request, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        finally:
            writer.close()


def client(**overrides: Any) -> WorkerStreamClient:
    settings: dict[str, Any] = {"headers": {"X-Cluster-Secret": "s3"}, "connect_timeout": 2.0,
                                "read_timeout": 5.0, "max_connections": 8}
    settings.update(overrides)
    return WorkerStreamClient(**settings)


async def read_body(pool: WorkerStreamClient, url: str, payload: dict[str, Any] | None = None) -> bytes:
    async with pool.stream(f"{url}/worker_generate_stream", payload or {"prompt": "hi"}) as body:
        return b"".join([piece async for piece in body])


async def test_request_line_headers_and_body() -> None:
    async with Server(stream_two) as server:
        host = server.url.removeprefix("http://")
        pool = client()
        token = REQUEST_ID.set("req-42")
        try:
            data = await read_body(pool, server.url, {"prompt": "héllo", "max_new_tokens": 3})
        finally:
            REQUEST_ID.reset(token)
        await pool.aclose()
    assert data == b'{"text":"a"}\0{"text":"ab"}\0'
    request = server.requests[0]
    assert request["line"] == "POST /worker_generate_stream HTTP/1.1"
    assert request["headers"]["host"] == host
    assert request["headers"]["content-type"] == "application/json"
    assert request["headers"]["x-cluster-secret"] == "s3"
    assert request["headers"]["x-request-id"] == "req-42"
    assert request["json"] == {"prompt": "héllo", "max_new_tokens": 3}


async def test_a_connection_is_reused_after_a_complete_answer() -> None:
    async with Server(stream_two) as server:
        pool = client()
        for _ in range(5):
            assert await read_body(pool, server.url) == b'{"text":"a"}\0{"text":"ab"}\0'
        await pool.aclose()
    assert len(server.requests) == 5
    assert server.connections == 1


async def test_an_idle_connection_the_worker_closed_is_replaced_without_an_error() -> None:
    async def once_per_connection(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        await stream_two(request, writer)
        return False  # close after each answer, as a worker's keep-alive timeout does

    async with Server(once_per_connection) as server:
        pool = client()
        for _ in range(3):
            assert await read_body(pool, server.url) == b'{"text":"a"}\0{"text":"ab"}\0'
            await asyncio.sleep(0.05)  # the close reaches the pooled connection
        await pool.aclose()
    assert len(server.requests) == 3  # each sent once
    assert server.connections == 3


async def test_a_reused_connection_lost_before_the_answer_is_retried_once_on_a_new_one() -> None:
    answered = 0

    async def drop_the_second(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        nonlocal answered
        answered += 1
        if answered == 2:
            return False  # closes without answering: the race with an idle close
        await stream_two(request, writer)
        return True

    async with Server(drop_the_second) as server:
        pool = client()
        assert await read_body(pool, server.url)
        assert await read_body(pool, server.url) == b'{"text":"a"}\0{"text":"ab"}\0'
        await pool.aclose()
    assert server.connections == 2
    assert len(server.requests) == 3


async def test_a_fresh_connection_lost_before_the_answer_is_unavailable() -> None:
    async def hang_up(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        return False

    async with Server(hang_up) as server:
        pool = client()
        with pytest.raises(WorkerUnavailableError, match="unreachable"):
            await read_body(pool, server.url)
        await pool.aclose()
    assert len(server.requests) == 1  # not retried: a fresh connection has no idle race


async def test_leaving_early_closes_the_connection() -> None:
    client_went = asyncio.Event()

    async def slow(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(OK_HEAD + b"d\r\n{\"text\":\"a\"}\0\r\n")
        await writer.drain()
        if await request["reader"].read(1) == b"":  # what a worker's disconnect watch sees
            client_went.set()
        return False

    async with Server(slow) as server:
        pool = client()
        async with pool.stream(f"{server.url}/worker_generate_stream", {}) as body:
            async for piece in body:
                assert piece == b'{"text":"a"}\0'
                break
        await asyncio.wait_for(client_went.wait(), 5)
        assert not any(pool._idle.values())
        await pool.aclose()


@pytest.mark.parametrize("keep", [b"connection: close\r\n", b""])
async def test_connection_close_is_not_pooled(keep: bytes) -> None:
    async def answer(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n" + keep + b"content-length: 2\r\n\r\nok")
        await writer.drain()
        return not keep

    async with Server(answer) as server:
        pool = client()
        assert await read_body(pool, server.url) == b"ok"
        assert await read_body(pool, server.url) == b"ok"
        await pool.aclose()
    assert server.connections == (2 if keep else 1)


async def test_a_body_ended_by_closing_the_connection() -> None:
    async def until_close(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 5000)
        await writer.drain()
        return False

    async with Server(until_close) as server:
        pool = client()
        assert await read_body(pool, server.url) == b"x" * 5000
        await pool.aclose()


async def test_a_large_body_arrives_whole_through_backpressure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_connection, "HIGH_WATER_BYTES", 4096)
    pieces = [bytes([65 + i % 26]) * 1000 for i in range(300)]

    async def big(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(OK_HEAD + chunked(*pieces))
        await writer.drain()
        return True

    async with Server(big) as server:
        pool = client()
        async with pool.stream(f"{server.url}/worker_generate_stream", {}) as body:
            got = []
            async for piece in body:
                got.append(piece)
                await asyncio.sleep(0)  # a slow reader
        assert b"".join(got) == b"".join(pieces)
        assert await read_body(pool, server.url) == b"".join(pieces)  # and the connection was reusable
        await pool.aclose()
    assert server.connections == 1


async def test_a_non_200_answer_is_its_typed_error() -> None:
    async def busy(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        body = json.dumps({"text": "too many requests", "error_code": 50007}).encode()
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        return True

    async with Server(busy) as server:
        pool = client()
        with pytest.raises(EngineOverloadedError) as info:
            await read_body(pool, server.url)
        assert info.value.retry_after == 7  # type: ignore[attr-defined]
        with pytest.raises(EngineOverloadedError):
            await read_body(pool, server.url)
        await pool.aclose()
    assert server.connections == 1  # the error's body was read: the connection stayed usable


async def test_a_silent_worker_times_out() -> None:
    async def silent_after_head(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(OK_HEAD)
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async def silent(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(1)
        return False

    for reply in (silent_after_head, silent):
        async with Server(reply) as server:
            pool = client(read_timeout=0.3)
            with pytest.raises(WorkerTimeoutError, match="did not answer within 0.3 s"):
                await read_body(pool, server.url)
            await pool.aclose()


async def test_a_worker_gone_mid_body_is_unavailable() -> None:
    async def cut(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(OK_HEAD + b"d\r\n{\"text\":\"a\"}\0\r\n")
        await writer.drain()
        return False

    async with Server(cut) as server:
        pool = client()
        got = []
        with pytest.raises(WorkerUnavailableError, match="unreachable"):
            async with pool.stream(f"{server.url}/worker_generate_stream", {}) as body:
                async for piece in body:
                    got.append(piece)
        assert got == [b'{"text":"a"}\0']
        await pool.aclose()


async def test_a_malformed_answer_is_unavailable() -> None:
    async def garbage(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async with Server(garbage) as server:
        pool = client()
        with pytest.raises(WorkerUnavailableError, match="malformed"):
            await read_body(pool, server.url)
        await pool.aclose()


async def test_refused_and_bad_addresses_are_unavailable() -> None:
    async with Server(stream_two) as server:
        url = server.url
    pool = client()
    with pytest.raises(WorkerUnavailableError, match="unreachable"):
        await read_body(pool, url)  # nobody listens there any more
    for bad in ("ftp://127.0.0.1:1", "http://127.0.0.1:99999", "http://127.0.0.1:port", "http:///x"):
        with pytest.raises(WorkerUnavailableError, match="not an http"):
            await read_body(pool, bad)
    await pool.aclose()
    with pytest.raises(WorkerUnavailableError, match="shutting down"):
        await read_body(pool, url)


def test_header_values_cannot_inject_lines() -> None:
    with pytest.raises(ValueError, match="line break"):
        WorkerStreamClient(headers={"X-Cluster-Secret": "a\r\nX-Evil: 1"}, connect_timeout=1.0,
                           read_timeout=1.0, max_connections=1)


async def test_the_connection_limit_queues_streams() -> None:
    release = asyncio.Event()

    async def held(request: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        await release.wait()
        await stream_two(request, writer)
        return True

    async with Server(held) as server:
        pool = client(max_connections=2)
        tasks = [asyncio.create_task(read_body(pool, server.url)) for _ in range(4)]
        await asyncio.sleep(0.3)
        assert len(server.requests) == 2  # two more wait for a slot
        release.set()
        assert all(r == b'{"text":"a"}\0{"text":"ab"}\0' for r in await asyncio.gather(*tasks))
        await pool.aclose()
    assert server.connections == 2


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ssl.SSLContext:
    """A server context with a self-signed certificate for 127.0.0.1 that clients trust."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


async def test_an_https_worker(tls: ssl.SSLContext) -> None:
    async with Server(stream_two, ssl_context=tls) as server:
        pool = client()
        assert server.url.startswith("https://")
        for _ in range(2):
            assert await read_body(pool, server.url) == b'{"text":"a"}\0{"text":"ab"}\0'
        await pool.aclose()
    assert server.connections == 1
