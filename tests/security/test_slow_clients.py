"""Slow and greedy clients against real services: a head or body sent a byte at a time, more
connections than the cap, more streams per key than `--max-streams-per-key`, and a stream whose
client stops reading (`llmplatform.utils.http_protocol`, `openai_api.limits`).

The deadlines here are small configured values (1 s), so each test is bounded; what is asserted
is what the server did (closed, refused, aborted), never how long it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from llmplatform.utils.http_protocol import ConnectionLimits
from llmplatform.utils.request_guard import read_body_bounded, replay
from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import (
    controller_app,
    gateway_app,
    idle,
    serve_worker,
    services,
    start_service,
    worker_app,
    worker_status,
)
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.fake_worker import MODEL as FAKE_MODEL
from tests.fake_worker import frame, make_fake_worker, register_worker
from tests.polling import wait_until
from tests.processes import free_port
from tests.security.raw_http import connect, host_of, read_response, wait_closed_by_server

# ---- slowloris and the connection cap, on a controller started by its own __main__ -----------------


def _controller(tmp_path: Path, *flags: str) -> Any:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_service("llmplatform.controller", ["--port", str(port), *flags],
                         tmp_path / "controller.log", f"{url}/health", url)


def test_slow_heads_and_bodies_are_cut_off_by_the_configured_deadlines(tmp_path: Path) -> None:
    with services(_controller(tmp_path, "--request-head-timeout", "1", "--request-body-timeout", "1")) as (ctl,):
        head = f"POST /list_models HTTP/1.1\r\nHost: {host_of(ctl.url)}\r\nX-Pad: {'a' * 300}\r\n\r\n"
        with connect(ctl.url) as sock:  # one header byte every 0.2 s: 60 s for the whole head
            assert wait_closed_by_server(sock, send=head.encode(), every_s=0.2) == b""
        with connect(ctl.url) as sock:  # the head at once, the body a byte at a time
            sock.sendall(f"POST /get_worker_address HTTP/1.1\r\nHost: {host_of(ctl.url)}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 300\r\n\r\n".encode())
            answer = wait_closed_by_server(sock, send=b" " * 300, every_s=0.2)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]  # tests/security/test_body_timeout.py
        # Prompt clients are served as before.
        assert httpx.post(f"{ctl.url}/list_models", timeout=10).json() == {"models": []}


def test_connections_past_the_cap_are_refused_and_service_resumes(tmp_path: Path) -> None:
    with services(_controller(tmp_path, "--max-connections", "3")) as (ctl,):
        held = [connect(ctl.url) for _ in range(3)]
        try:
            for sock in held:
                sock.sendall(b"POST /list_models HTTP/1.1\r\n")  # open, mid-request
            with connect(ctl.url) as extra:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    extra.sendall(f"POST /list_models HTTP/1.1\r\nHost: {host_of(ctl.url)}\r\n\r\n".encode())
                status, raw = read_response(extra)
            assert status in (503, 0) and b'"models"' not in raw, raw[:300]
        finally:
            for sock in held:
                sock.close()

        def served() -> bool:
            try:
                return httpx.post(f"{ctl.url}/list_models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(served, timeout_s=30, what="the controller serving again")


# ---- --max-streams-per-key, on a gateway in front of a worker whose streams can be held open --------

HOLD = "HOLD"
KEY_A, KEY_B = "sk-stream-a", "sk-stream-b"


class _HeldStreams:
    """Wraps the fake worker: a generation whose prompt says HOLD sends one chunk and then waits
    for `release` (bounded) before finishing; every other request goes to the fake worker."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/worker_generate_stream":
            await self.inner(scope, receive, send)
            return
        body = await read_body_bounded(receive, None) or b""
        if HOLD.encode() not in body:
            await self.inner(scope, replay(body, receive), send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        chunk = {"text": "held", "error_code": 0, "usage": usage, "finish_reason": None}
        await send({"type": "http.response.body", "body": frame(chunk), "more_body": True})
        await asyncio.to_thread(self.release.wait, 60)  # bounded: a failing test must not hang
        last = frame({**chunk, "finish_reason": "stop"})
        await send({"type": "http.response.body", "body": last})


@dataclass
class StreamCluster:
    gateway: str
    worker: _HeldStreams


@contextlib.contextmanager
def _stream_cluster(**gateway_settings: Any) -> Iterator[StreamCluster]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        inner, _ = make_fake_worker([FAKE_MODEL])
        worker = _HeldStreams(inner)
        worker_url = stack.enter_context(serve_in_thread(worker))
        register_worker(controller, worker_url, [FAKE_MODEL])
        wait_for_models(controller, [FAKE_MODEL])
        gateway = stack.enter_context(serve_in_thread(gateway_app(controller, **gateway_settings)))
        try:
            yield StreamCluster(gateway, worker)
        finally:
            worker.release.set()


def _client(gateway: str, key: str, local_address: str | None = None) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(local_address=local_address)) if local_address else None
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=30, http_client=http)


def _stream_text(client: openai.OpenAI, prompt: str = "hi") -> str:
    stream = client.chat.completions.create(model=FAKE_MODEL, stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": prompt}])
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@contextlib.contextmanager
def _held_stream(client: openai.OpenAI) -> Iterator[None]:
    """A stream that is open (its first event read) until the block ends and the worker lets
    it finish; read to its end on the way out."""
    stream = client.chat.completions.create(model=FAKE_MODEL, stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": HOLD}])
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].delta.role == "assistant" or first.choices[0].delta.content
    yield
    rest = list(chunks)
    # Released, it finishes as the worker ends it: the cap never cut an admitted stream.
    assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["stop"], rest


def _refused(client: openai.OpenAI) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        _stream_text(client)
    return info.value


def _can_stream(client: openai.OpenAI) -> bool:
    try:
        return bool(_stream_text(client))
    except openai.RateLimitError:
        return False


def test_one_stream_per_key_a_second_is_429_until_the_first_ends() -> None:
    with _stream_cluster(api_keys=(KEY_A, KEY_B), max_streams_per_key=1) as cluster:
        a, b = _client(cluster.gateway, KEY_A), _client(cluster.gateway, KEY_B)
        with _held_stream(a):
            error = _refused(a)
            assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
            envelope = error.response.json()["error"]
            assert set(envelope) == {"message", "type", "param", "code"}
            assert envelope["code"] == "rate_limit_exceeded" and "streams" in envelope["message"]
            assert _stream_text(b)  # another key streams
            answer = a.chat.completions.create(model=FAKE_MODEL, max_tokens=8,  # not a stream
                                               messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content
            cluster.worker.release.set()
        wait_until(lambda: _can_stream(a), timeout_s=30, what="key A streaming again")


def test_without_keys_the_cap_is_per_client_address() -> None:
    with _stream_cluster(max_streams_per_key=1) as cluster:
        here = _client(cluster.gateway, "anything")
        with _held_stream(here):
            _refused(here)
            _refused(_client(cluster.gateway, "another-token"))  # a made-up key is no way around it
            assert _stream_text(_client(cluster.gateway, "x", local_address="127.0.0.2"))
            cluster.worker.release.set()


def test_the_cap_is_off_by_default() -> None:
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    assert GatewayServiceSettings.parse([]).gateway_settings.max_streams_per_key is None
    assert GatewayServiceSettings.parse(["--max-streams-per-key", "2"]).gateway_settings.max_streams_per_key == 2
    with _stream_cluster(api_keys=(KEY_A,)) as cluster:
        a = _client(cluster.gateway, KEY_A)
        with _held_stream(a), _held_stream(a):
            assert _stream_text(a)
            cluster.worker.release.set()


# ---- a stream nobody reads, through the gateway to a real worker ------------------------------------

STALL_LIMITS = ConnectionLimits(write_stall_timeout_s=1.0, send_buffer_bytes=4096)
"""A 1 s stall timeout; and a send buffer as a real network would have (loopback lets the kernel
take megabytes from a client that does not read, more than the tiny model's longest answer)."""


@pytest.fixture(scope="module")
def real_cluster(tiny_model_dir: Path) -> Iterator[tuple[str, str, Any]]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        app = worker_app(paged_tiny_llm(tiny_model_dir), controller)
        worker = stack.enter_context(serve_worker(app))
        wait_for_models(controller, ["tiny"])
        gateway = stack.enter_context(serve_in_thread(gateway_app(controller), limits=STALL_LIMITS))
        yield gateway, worker, app


def test_a_stream_whose_client_stops_reading_is_cut_and_its_worker_slot_freed(
        real_cluster: tuple[str, str, Any]) -> None:
    gateway, worker, app = real_cluster
    registry = app.state.metrics.registry

    def aborted() -> float:
        labels = {"model_name": "tiny", "finished_reason": "abort"}
        return registry.get_sample_value("llmplatform:request_success_total", labels) or 0.0

    baseline, aborted_before = idle(worker_status(worker)), aborted()
    body = json.dumps({"model": "tiny", "stream": True, "max_tokens": 400, "temperature": 1.0,
                       "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host_of(gateway)}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with connect(gateway, receive_buffer_bytes=4096) as sock:
        sock.sendall(request)  # ...and never read
        wait_until(lambda: aborted() > aborted_before, timeout_s=120, what="the worker aborting the generation")
        wait_until(lambda: idle(worker_status(worker)) == baseline, timeout_s=30, what="the worker idle again")
        status, raw = read_response(sock)
    assert status == 200
    assert b"data: [DONE]" not in raw  # cut in the middle, not finished
