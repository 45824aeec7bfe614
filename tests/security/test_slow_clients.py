"""Slow and greedy clients against real services: a head or body sent a byte at a time, more
connections than the cap, and a stream whose client stops reading
(`llmplatform.utils.http_protocol`). More requests per key than its limits:
test_tenant_limits.py.

The deadlines here are small configured values (1 s), so each test is bounded; what is asserted
is what the server did (closed, refused, aborted), never how long it took.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmplatform.utils.http_protocol import ConnectionLimits
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
from tests.faults.faulty_runner import Faults
from tests.integration.cluster import paged_tiny_llm, wait_for_models
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


# ---- a stream nobody reads, through the gateway to a real worker ------------------------------------

STALL_LIMITS = ConnectionLimits(write_stall_timeout_s=1.0, send_buffer_bytes=4096)
"""A 1 s stall timeout; and a send buffer as a real network would have (loopback lets the kernel
take megabytes from a client that does not read, more than the tiny model's longest answer)."""
STEP_DELAY_S = 0.025
"""Each step of the worker's engine this much slower: its 400 tokens take over 10 s, so the
generation is still running when the 1 s stall cuts the stream on any machine (unslowed, the
tiny model could finish them before the cut reached it, and nothing was left to abort)."""


@pytest.fixture(scope="module")
def real_cluster(tiny_model_dir: Path) -> Iterator[tuple[str, str, Any]]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        app = worker_app(paged_tiny_llm(tiny_model_dir,
                                        runner_factory=Faults(step_delay_s=STEP_DELAY_S).runner_factory()),
                         controller)
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
