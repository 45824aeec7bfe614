"""The services' uvicorn protocol (``llmplatform.utils.http_protocol``): answers leave as they are
written, and slow and greedy clients are cut off within the bounds of a ``ConnectionLimits``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from llmplatform.utils.http_protocol import ConnectionLimits
from llmplatform.utils.server import serve_in_thread
from llmplatform.utils.service_settings import ServerSettings
from tests.polling import wait_until
from tests.security.raw_http import connect, read_response, wait_closed_by_server


def test_headers_are_not_held_until_the_body() -> None:
    """A response that starts and then waits: its headers reach the client while it waits."""
    headers_seen = threading.Event()

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"4")]})
        while not headers_seen.is_set():  # only the client can end this wait
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"done"})

    with serve_in_thread(app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(4096)
                assert chunk, "the server closed before sending headers"
                received += chunk
            assert received.startswith(b"HTTP/1.1 200 OK") and b"done" not in received
            headers_seen.set()
            while not received.endswith(b"done"):
                chunk = sock.recv(4096)
                assert chunk
                received += chunk


@pytest.mark.parametrize("size", [10, 300_000])
def test_bodies_arrive_whole_through_a_real_server(size: int) -> None:
    payload = bytes(range(256)) * (size // 256 + 1)

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(size * 3).encode())]})
        for _ in range(3):
            await send({"type": "http.response.body", "body": payload[:size], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    import httpx

    with serve_in_thread(app) as url, httpx.Client(trust_env=False) as client:
        for _ in range(2):  # and the connection is reused
            response = client.get(url)
            assert response.status_code == 200
            assert response.content == payload[:size] * 3


# ---- slow and greedy clients (ConnectionLimits) -----------------------------------------------------


def test_connection_limits_are_checked_and_zero_turns_one_off() -> None:
    for bad in (dict(max_connections=0), dict(head_timeout_s=0), dict(write_stall_timeout_s=-1.0),
                dict(send_buffer_bytes=True)):
        with pytest.raises(ValueError):
            ConnectionLimits(**bad)  # type: ignore[arg-type]
    assert ServerSettings.parse([]).connection_limits() == ConnectionLimits()
    limits = ServerSettings.parse(
        ["--max-connections", "0", "--request-head-timeout", "2.5", "--write-stall-timeout", "0"]
    ).connection_limits()
    assert limits.max_connections is None and limits.head_timeout_s == 2.5
    assert limits.write_stall_timeout_s is None
    with pytest.raises(SystemExit):
        ServerSettings.parse(["--request-body-timeout", "-1"])


class _BodyReader:
    """An app that reads the whole body, then answers its length; notes a disconnect."""

    def __init__(self) -> None:
        self.disconnected = threading.Event()

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = str(size).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


SLOW = ConnectionLimits(head_timeout_s=1.0, body_timeout_s=1.0)
LONG_HEAD = b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 400 + b"\r\n\r\n"


def test_a_head_sent_a_byte_at_a_time_is_cut_off() -> None:
    with serve_in_thread(_BodyReader(), limits=SLOW) as url, connect(url) as sock:
        # 400 bytes at 5 a second would take 80 s: the server closes long before.
        assert wait_closed_by_server(sock, send=LONG_HEAD, every_s=0.2) == b""


def test_a_connection_that_sends_nothing_is_cut_off() -> None:
    with serve_in_thread(_BodyReader(), limits=SLOW) as url, connect(url) as sock:
        assert wait_closed_by_server(sock) == b""


def test_a_body_sent_a_byte_at_a_time_is_cut_off_and_the_route_told() -> None:
    app = _BodyReader()
    with serve_in_thread(app, limits=SLOW) as url, connect(url) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n")
        # The server answers 408 itself (logs and metrics then say 408, not 500), then closes.
        answer = wait_closed_by_server(sock, send=b"b" * 400, every_s=0.2)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert app.disconnected.wait(timeout=30)


def test_prompt_clients_are_not_cut_off() -> None:
    """Same deadlines, a client that sends at once: answered, on one connection, request after
    request, however long it then waits between them (uvicorn's keep-alive rules that)."""
    with serve_in_thread(_BodyReader(), limits=SLOW) as url, connect(url) as sock:
        for _ in range(3):
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            received = b""
            while not received.endswith(b"\r\n\r\n5"):
                chunk = sock.recv(4096)
                assert chunk, received
                received += chunk
            assert received.startswith(b"HTTP/1.1 200 ")


def test_connections_beyond_the_cap_are_refused_until_some_close() -> None:
    import httpx

    with serve_in_thread(_BodyReader(), limits=ConnectionLimits(max_connections=3)) as url:
        held = [connect(url) for _ in range(3)]
        try:
            for sock in held:  # in the middle of a head: open, not idle between requests
                sock.sendall(b"GET / HTTP/1.1\r\n")
            with connect(url) as extra:
                try:
                    extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                status, raw = read_response(extra)
            assert status in (503, 0), raw[:200]  # a 503, or closed before one could be read
            assert b"200 OK" not in raw
        finally:
            for sock in held:
                sock.close()
        wait_until(lambda: httpx.get(url, timeout=5).status_code == 200, retry_on=(httpx.HTTPError,),
                   timeout_s=30, what="served again once the held connections closed")


def test_a_client_that_stops_reading_is_cut_off_and_the_route_told() -> None:
    """An endless response to a client that never reads: once the buffers are full, the write
    stalls; after the stall timeout the connection is aborted and the route sees the disconnect
    (without it, the route would wait in `send` for ever)."""
    told = threading.Event()
    sent_bytes = [0]

    async def endless(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await receive()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            told.set()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * 16384
        while not told.is_set():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent_bytes[0] += len(chunk)
            await asyncio.sleep(0)  # as a stream waiting on its source does: writes leave per turn
        watcher.cancel()

    limits = ConnectionLimits(write_stall_timeout_s=1.0, send_buffer_bytes=4096)
    with serve_in_thread(endless, limits=limits) as url:
        with connect(url, receive_buffer_bytes=4096) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert told.wait(timeout=60), "the route is still blocked writing to a client that left"
            stalled_at = sent_bytes[0]
            time.sleep(0.2)
            assert sent_bytes[0] == stalled_at  # and it stopped writing
            with pytest.raises((ConnectionResetError, AssertionError)):
                read_response(sock)  # what was buffered, then the reset of an aborted connection
                raise AssertionError("closed without a reset")
