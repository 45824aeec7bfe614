"""HTTP over a plain socket, for requests no HTTP client would send: a head sent a byte at a time,
a body that never ends, a client that never reads."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit


def connect(url: str, *, timeout: float = 30.0, receive_buffer_bytes: int | None = None) -> socket.socket:
    """A TCP connection to `url`'s host and port (SO_RCVBUF set before connecting, so the
    window the server sees is small from the start)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.settimeout(timeout)
    sock.connect((parts.hostname, parts.port))
    return sock


def host_of(url: str) -> str:
    return urlsplit(url).netloc


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and everything the server sent until it closed the connection (the servers
    close after every refusal: `Connection: close`)."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    return status, received


def wait_closed_by_server(sock: socket.socket, *, send: bytes = b"", every_s: float = 0.2,
                          timeout_s: float = 60.0) -> bytes:
    """Send `send` one byte every `every_s` seconds, reading what comes back, until the server
    closes the connection; returns what it sent. AssertionError if the connection is still open
    after `timeout_s` (or `send` ran out first)."""
    sock.settimeout(every_s)
    received = b""
    deadline = time.monotonic() + timeout_s
    position = 0
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
            if not chunk:
                return received
            received += chunk
            continue
        except TimeoutError:
            pass
        except ConnectionResetError:
            return received
        if send:
            assert position < len(send), "the whole head was sent and the server still waits"
            try:
                sock.send(send[position:position + 1])
            except (BrokenPipeError, ConnectionResetError):
                return received
            position += 1
    raise AssertionError(f"the server kept the connection open for {timeout_s} s")
