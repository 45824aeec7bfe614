"""A request body trickled in past `--request-body-timeout` is a 408: on the wire, in the
gateway's access line and in its `/metrics` counter (a real gateway process, its deadline set to
1 s). Before, the guard's read saw a disconnect, the app returned without answering, and the
line and the counter said 500. The controller (started by its own __main__) answers 408 too."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import controller_app, services, start_service
from tests.polling import wait_until
from tests.processes import free_port
from tests.security.raw_http import connect, host_of, wait_closed_by_server

def _trickle(url: str, path: str) -> bytes:
    """The head at once, then a 300-byte body one byte every 0.2 s; what the server sent back
    before it closed the connection."""
    with connect(url) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host_of(url)}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 300\r\n\r\n".encode())
        return wait_closed_by_server(sock, send=b" " * 300, every_s=0.2, timeout_s=30)


def _service(module: str, tmp_path: Path, *flags: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_service(module, ["--port", str(port), "--request-body-timeout", "1", *flags],
                         tmp_path / f"{module}.log", f"{url}/health", url)


def test_a_trickled_body_is_a_408_in_the_gateways_log_and_metrics(tmp_path: Path) -> None:
    with serve_in_thread(controller_app()) as controller, \
            services(_service("llmplatform.openai_api", tmp_path, "--controller-address",
                              controller)) as (gateway,):
        answer = _trickle(gateway.url, "/v1/chat/completions")
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b'"code": "request_timeout"' in answer
        wait_until(lambda: "POST /v1/chat/completions -> 408" in gateway.output(), timeout_s=10,
                   what="the 408 access line", context=gateway.output)
        assert "POST /v1/chat/completions -> 500" not in gateway.output()
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        counted = re.findall(r'^llmplatform:gateway_requests_total\{([^}]*)\} (\S+)$', metrics, re.M)
        # Its route is "unmatched": the body is read (and timed out) before routing.
        statuses = {labels: float(value) for labels, value in counted if "/health" not in labels}
        assert statuses == {'model="",route="unmatched",status="408"': 1.0}, statuses


def test_the_controller_answers_a_trickled_body_with_408(tmp_path: Path) -> None:
    controller = _service("llmplatform.controller", tmp_path)
    with services(controller):
        answer = _trickle(controller.url, "/get_worker_address")
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        wait_until(lambda: "did not arrive within 1 s (408)" in controller.output(), timeout_s=10,
                   what="the 408 warning", context=controller.output)
