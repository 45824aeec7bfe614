"""Log lines (one per event, text or JSON, tagged with the request id), the services' startup
summaries and the weight-loading progress bar, on real services and real weights."""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.kernels import cpu_decode
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.logs import JsonFormatter, TextFormatter, request_context
from llmplatform.controller.__main__ import controller_summary
from llmplatform.model_worker.__main__ import worker_summary
from llmplatform.openai_api.__main__ import gateway_summary
from tests.polling import wait_until

LINE_TIMEOUT_S = 120


def _record(message: str, *, exc: bool = False, **extra) -> logging.LogRecord:
    logger = logging.getLogger("llmplatform.test")
    exc_info = None
    if exc:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            exc_info = sys.exc_info()
    return logger.makeRecord(logger.name, logging.ERROR, __file__, 1, message, (), exc_info,
                             extra=extra or None)


def test_json_lines_carry_the_request_id_extras_and_tracebacks_on_one_line():
    from llmplatform.utils.logs import install_request_id_logging

    install_request_id_logging()
    with request_context("req-7"):
        line = JsonFormatter().format(_record("two\nlines", exc=True, summary={"a": 1}))
    assert "\n" not in line
    data = json.loads(line)
    assert data["request_id"] == "req-7" and data["message"] == "two\nlines"
    assert data["level"] == "ERROR" and data["logger"] == "llmplatform.test"
    assert data["summary"] == {"a": 1} and "ValueError: boom" in data["exc_info"]
    outside = json.loads(JsonFormatter().format(_record("plain")))
    assert "request_id" not in outside


def test_text_lines_are_one_line_with_the_id_in_brackets():
    from llmplatform.utils.logs import install_request_id_logging

    install_request_id_logging()
    with request_context("req-8"):
        line = TextFormatter().format(_record("hello\nworld", exc=True))
    assert "\n" not in line
    assert " ERROR llmplatform.test [req-8]: hello\\nworld | Traceback" in line


def test_worker_summary_states_backend_kv_cache_and_addresses(tiny_model_dir):
    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                  backend="paged", device="cpu", dtype="float32",
                                  kv_cache_memory="8MiB", max_model_len=256))
    layout = llm.engine.runner.layout
    settings = WorkerSettings(worker_address="http://10.0.0.5:21002",
                              controller_address="http://10.0.0.1:21001",
                              limit_worker_concurrency=1024)
    summary = worker_summary(llm, settings, "http://0.0.0.0:21002")
    assert summary["model"] == "tiny" and summary["backend"] == "paged"
    assert summary["dtype"] == "float32" and summary["device"] == "cpu"
    assert summary["attention"] == ("cpu" if cpu_decode.available() else "torch")
    assert summary["kv_cache"] == (f"{layout.num_blocks} blocks x 16 tokens = "
                                   f"{layout.num_blocks * 16} tokens")
    assert summary["max_model_len"] == 256
    assert summary["address"] == "http://10.0.0.5:21002"
    assert summary["controller"] == "http://10.0.0.1:21001"
    assert summary["metrics"] == "http://0.0.0.0:21002/metrics"

    hf = HFTransformersLLM(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32")
    summary = worker_summary(hf, WorkerSettings(register=False), "http://127.0.0.1:1")
    assert summary["backend"] == "hf" and summary["kv_cache"] == "per request (no shared pool)"
    assert "attention" not in summary
    assert summary["controller"] == "none (not registering)"


def test_gateway_and_controller_summaries():
    gateway = gateway_summary(GatewaySettings(controller_address="http://c:1", api_keys=("k",)),
                              "http://127.0.0.1:8000")
    assert gateway["auth"] == "on" and gateway["api"] == "http://127.0.0.1:8000/v1"
    assert gateway_summary(GatewaySettings(), "http://h:1")["auth"] == "off"
    controller = controller_summary(ControllerConfig(heartbeat_expiration=12.5), "http://h:2")
    assert controller["heartbeat_expiration"] == "12.5s" and controller["dispatch"]


def test_loading_weights_shows_a_progress_bar(tiny_model_dir, monkeypatch, capsys):
    from llmplatform.models.loader import load_model

    monkeypatch.setenv("LLMPLATFORM_PROGRESS", "1")
    load_model(tiny_model_dir)
    err = capsys.readouterr().err
    assert "Loading weights" in err and "100%" in err


# ---- a real service process ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Lines:
    """A process's stderr lines, read on a thread (so a wait is bounded in time)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.queue.put(line.rstrip("\n"))

    def until(self, predicate) -> str:
        def next_match() -> str | None:
            while True:
                try:
                    line = self.queue.get_nowait()
                except queue.Empty:
                    return None
                self.seen.append(line)
                if predicate(line):
                    return line

        return wait_until(next_match, timeout_s=LINE_TIMEOUT_S, interval_s=0.1, what="a matching line",
                          context=lambda: f"got: {self.seen[-20:]}")


@pytest.fixture
def json_service():
    procs: list[subprocess.Popen] = []

    def start(module: str, *args: str) -> tuple[subprocess.Popen, _Lines, str]:
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
             "--log-format", "json", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        procs.append(proc)
        return proc, _Lines(proc), f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_controller_logs_json_lines_with_its_summary_and_request_ids(json_service):
    proc, lines, url = json_service("llmplatform.controller", "--dispatch-method", "lottery")
    summary = json.loads(lines.until(lambda line: "llmplatform controller" in line))
    assert summary["summary"]["dispatch"] == "lottery"
    assert summary["summary"]["listen"] == url
    lines.until(lambda line: "Uvicorn running" in line)
    for _ in range(3):  # what each gateway's routing table reads every second: not logged at info
        assert httpx.get(f"{url}/list_workers", timeout=10).status_code == 200
    response = httpx.post(f"{url}/list_models", headers={"X-Request-Id": "ctl-1"}, timeout=10)
    assert response.status_code == 200 and response.headers["x-request-id"] == "ctl-1"
    # uvicorn's own access line, in our format, tagged with the caller's id.
    access = json.loads(lines.until(lambda line: "/list_models" in line))
    assert access["logger"] == "uvicorn.access" and access["request_id"] == "ctl-1"
    assert not any("/list_workers" in line for line in lines.seen)
    assert not any("color_message" in line for line in lines.seen)  # uvicorn's ANSI copy
    assert all(_is_json(line) for line in lines.seen), [l for l in lines.seen if not _is_json(l)]


def test_worker_prints_its_summary_at_start(json_service, tiny_model_dir):
    proc, lines, url = json_service("llmplatform.model_worker", "--model-path", str(tiny_model_dir),
                                    "--model-names", "tiny", "--backend", "paged", "--device",
                                    "cpu", "--dtype", "float32", "--kv-cache-memory", "8MiB",
                                    "--no-register")
    summary = json.loads(lines.until(lambda line: "llmplatform worker" in line))["summary"]
    assert summary["backend"] == "paged" and summary["dtype"] == "float32"
    assert summary["kv_cache"].endswith(" tokens") and " blocks x 16 tokens = " in summary["kv_cache"]
    assert summary["max_model_len"] == 512 and summary["address"] == url
    lines.until(lambda line: "Uvicorn running" in line)
    metrics = httpx.get(f"{url}/metrics", timeout=10)
    assert 'llmplatform:num_requests_running{model_name="tiny"} 0.0' in metrics.text
    # JSON mode: no progress bar or stray print breaks the one-object-per-line stream.
    assert all(_is_json(line) for line in lines.seen), [l for l in lines.seen if not _is_json(l)]


def test_gateway_logs_one_access_line_per_request_its_own(json_service):
    """uvicorn's access line is off in the gateway: the gateway's own line (status, time, model,
    request id) is the one line per request, for the generation routes and the others alike."""
    _, controller_lines, controller = json_service("llmplatform.controller")
    controller_lines.until(lambda line: "Uvicorn running" in line)
    _, lines, url = json_service("llmplatform.openai_api", "--controller-address", controller)
    lines.until(lambda line: "Uvicorn running" in line)
    missing = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"},
                         headers={"X-Request-Id": "gw-1"}, timeout=10)
    assert missing.status_code == 404
    assert httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "gw-2"}, timeout=10).status_code == 200
    for request_id, path in (("gw-1", "POST /v1/completions -> 404"), ("gw-2", "GET /v1/models -> 200")):
        access = json.loads(lines.until(lambda line, p=path: p in line))
        assert access["logger"] == "llmplatform.openai_api.access" and access["request_id"] == request_id
    assert not any("uvicorn.access" in line for line in lines.seen)
