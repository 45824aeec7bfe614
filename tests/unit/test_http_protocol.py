"""The services' uvicorn protocol: one loop turn's writes leave in one send, and nothing is held
past the turn (``llmplatform.utils.http_protocol``)."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from llmplatform.utils.http_protocol import _TurnBuffer
from llmplatform.utils.server import serve_in_thread


class _RecordingTransport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def _next_turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_writes_of_one_turn_leave_together_in_order() -> None:
    real = _RecordingTransport()
    buffered = _TurnBuffer(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    buffered.write(b"HTTP/1.1 200 OK\r\n\r\n")
    buffered.write(bytearray(b"a"))
    buffered.write(b"")
    buffered.writelines([b"b", memoryview(b"c")])
    assert real.sent == []  # held until the turn ends
    assert buffered.get_write_buffer_size() == 22
    await _next_turn()
    assert real.sent == [b"HTTP/1.1 200 OK\r\n\r\nabc"]
    buffered.write(b"next")
    await _next_turn()
    assert real.sent[1:] == [b"next"]


async def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    real = _RecordingTransport()
    buffered = _TurnBuffer(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    buffered.write(b"last words")
    buffered.close()
    assert real.sent == [b"last words"] and real.closed
    await _next_turn()  # the scheduled flush finds nothing to send
    assert real.sent == [b"last words"]

    other = _RecordingTransport()
    buffered = _TurnBuffer(other, asyncio.get_running_loop())  # type: ignore[arg-type]
    buffered.write(b"never")
    buffered.abort()
    await _next_turn()
    assert other.sent == [] and other.aborted


async def test_writes_after_the_peer_left_are_dropped() -> None:
    real = _RecordingTransport()
    buffered = _TurnBuffer(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    buffered.write(b"late")
    real.closed = True  # uvicorn noticed the disconnect in the meantime
    await _next_turn()
    assert real.sent == []
    assert buffered.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is delegated


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
