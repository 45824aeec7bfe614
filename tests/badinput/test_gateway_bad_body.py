"""Bad request bodies at the gateway, as bytes: malformed or non-object JSON, a content type that
is not JSON, invalid UTF-8 and lone surrogates, and bodies over the size cap (declared, or
streamed in chunks). Each gets OpenAI's error envelope with its status (never a 500), a refused
request never reaches a worker, and the server keeps serving.

A real controller, a fake worker (validating as the real one does) and the gateway, as uvicorn
servers on 127.0.0.1 (`cluster` and `http` in conftest.py). Bad fields in well-formed bodies are
in test_gateway_bad_fields.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.badinput.conftest import chat, completion, post_refused
from tests.fake_worker import FakeCluster, fake_cluster

pytestmark = pytest.mark.usefixtures("still_serving")


# ---- the body itself --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b'{"model": "fake-model", "messages": [',
        b"",
        b"   ",
        b"[]",
        b'"a string"',
        b"42",
        b"null",
        b'[{"model": "fake-model"}]',
    ],
    ids=["malformed", "truncated", "empty", "blank", "list", "string", "number", "null", "list-of-objects"],
)
def test_malformed_or_non_object_body_is_400(cluster: FakeCluster, http: httpx.Client, path: str, raw: bytes) -> None:
    error = post_refused(cluster, http, path, 400, content=raw, headers={"Content-Type": "application/json"})
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/xml"],
)
def test_wrong_content_type_is_400(cluster: FakeCluster, http: httpx.Client, content_type: str) -> None:
    raw = json.dumps(chat()).encode()  # valid JSON, declared as something else
    error = post_refused(cluster, http, "/v1/chat/completions", 400, content=raw, headers={"Content-Type": content_type})
    assert "Content-Type" in error["message"]


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8", "APPLICATION/JSON"])
def test_json_content_types_are_accepted(http: httpx.Client, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    raw = json.dumps(chat(max_tokens=1)).encode()
    request = http.build_request("POST", "/v1/chat/completions", content=raw, headers=headers)
    assert request.headers.get("Content-Type") == content_type  # httpx adds none for raw content
    assert http.send(request).status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "caf\xe9"}]}',  # latin-1
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xc3"}]}',  # half a char
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # CESU
        b'{"model": "fake-model\xff", "messages": [{"role": "user", "content": "x"}]}',
    ],
    ids=["latin1", "truncated", "encoded-surrogate", "in-model"],
)
def test_invalid_utf8_is_400(cluster: FakeCluster, http: httpx.Client, raw: bytes) -> None:
    post_refused(cluster, http, "/v1/chat/completions", 400, content=raw, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "\\ud800x", "\\udc00\\ud800", "\\ud83d"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_lone_surrogate_escapes_are_400(cluster: FakeCluster, http: httpx.Client, escape: str, path: str) -> None:
    if path == "/v1/completions":
        raw = '{"model": "fake-model", "prompt": "a %s b"}' % escape
    else:
        raw = '{"model": "fake-model", "messages": [{"role": "user", "content": "a %s b"}]}' % escape
    post_refused(cluster, http, path, 400, content=raw.encode(), headers={"Content-Type": "application/json"})


def test_a_valid_surrogate_pair_is_fine(http: httpx.Client) -> None:
    raw = b'{"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}).status_code == 200


# ---- the body size cap --------------------------------------------------------------------------------


def test_body_over_the_cap_is_413(cluster: FakeCluster, http: httpx.Client) -> None:
    big = "w " * (3 * 1024 * 1024)  # 6 MiB of prompt, over the 4 MiB default
    error = post_refused(cluster, http, "/v1/completions", 413, json=completion(prompt=big))
    assert error["code"] == "request_too_large"
    assert "4194304" in error["message"]


def _raw_exchange(base_url: str, head: bytes, body_parts: list[bytes], timeout: float = 10.0) -> tuple[int, bytes, int]:
    """Send a request head and then body parts over a plain socket, stopping as soon as the
    server has answered. Returns (status, response bytes, body parts sent before the answer)."""
    import select
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head)
        sent = 0
        for part in body_parts:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                break  # the server answered before the body was complete
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
        response = b""
        while not _complete(response):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    status = int(response.split(b" ", 2)[1]) if response else 0
    return status, response, sent


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False  # read until the server closes


@pytest.fixture(scope="module")
def small_cap_gateway() -> Iterator[FakeCluster]:
    from llmplatform.openai_api.settings import RequestLimits

    with fake_cluster(limits=RequestLimits(max_request_bytes=64 * 1024)) as cluster:
        yield cluster


def test_declared_length_over_the_cap_is_refused_before_the_body(small_cap_gateway: FakeCluster) -> None:
    # Declares 100 MB and sends none of it: the answer comes at once, from the header alone.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n")
    status, response, _ = _raw_exchange(small_cap_gateway.gateway, head, [])
    assert status == 413, response
    assert b"request_too_large" in response
    assert small_cap_gateway.worker.received() == 0


def test_chunked_body_over_the_cap_is_refused_while_it_streams(small_cap_gateway: FakeCluster) -> None:
    # 64 KiB cap; the body comes in 8 KiB chunks, 200 of them (1.6 MB) if nobody stops it. The
    # server must answer 413 once it has read past the cap, long before the body ends.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"2000\r\n" + b"w" * 0x2000 + b"\r\n"
    status, response, sent = _raw_exchange(small_cap_gateway.gateway, head, [chunk] * 200)
    assert status == 413, response
    assert sent < 200, "the server read the whole oversized body before refusing it"
    assert small_cap_gateway.worker.received() == 0


def test_body_under_the_cap_streams_through(small_cap_gateway: FakeCluster) -> None:
    body = json.dumps(completion(prompt="w " * 20, max_tokens=1)).encode()
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]
    chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    status, response, _ = _raw_exchange(small_cap_gateway.gateway, head, chunks)
    assert status == 200, response
    with httpx.Client(base_url=small_cap_gateway.gateway) as http:  # and the server keeps serving
        assert http.post("/v1/completions", json=completion(max_tokens=1)).status_code == 200
