"""SIGTERM on every service: it stops accepting, lets in-flight requests finish within
`--shutdown-timeout`, a worker deregisters from the controller at once, and the process exits
without leaving children behind.

Each service under test runs as its own `python -m ...` subprocess and gets a real SIGTERM; the
peers it talks to run in-process. "In flight" is made certain, not hoped for: requests queue
behind one concurrency slot, or an in-process engine's steps are slowed, so that at the moment
of the signal several requests have seconds of work left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import (
    MODEL, controller_app, list_models, services, start_service, start_worker, serve_worker,
    worker_app, worker_status,
)
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.polling import wait_until
from tests.processes import alive, children_of, free_port

STOPPED = (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down gracefully
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_new_tokens": 480, "temperature": 0,
        "ignore_eos": True, "echo": False}


def read_worker_stream(url: str) -> dict[str, Any]:
    """A whole /worker_generate_stream answer; its last object, or what broke it."""
    last: dict[str, Any] = {}
    try:
        with httpx.stream("POST", f"{url}/worker_generate_stream", json=LONG, timeout=60) as response:
            if response.status_code != 200:
                return {"status": response.status_code}
            buffer = b""
            for data in response.iter_bytes():
                buffer += data
                *frames, buffer = buffer.split(b"\0")
                for frame in frames:
                    if frame.strip():
                        last = json.loads(frame)
    except httpx.HTTPError as exc:
        return {"broken": type(exc).__name__, **last}
    return last


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def slowed(llm: Any, delay: float) -> Any:
    runner = llm.engine.runner
    real_execute = runner.execute

    def slow_execute(scheduled: Any) -> Any:
        time.sleep(delay)
        return real_execute(scheduled)

    runner.execute = slow_execute
    return llm


@pytest.fixture
def controller_url():
    # A long expiry: a worker that disappears quickly can only have deregistered.
    with serve_in_thread(controller_app(heartbeat_expiration=60.0)) as url:
        yield url


def test_worker_sigterm_drains_and_deregisters(controller_url, tiny_model_dir, tmp_path):
    worker = start_worker(tiny_model_dir, controller_url, tmp_path,
                          extra=["--limit-worker-concurrency", "1", "--shutdown-timeout", "30"])
    with services(worker), ThreadPoolExecutor(3) as pool:
        wait_for_models(controller_url, [MODEL])
        streams = [pool.submit(read_worker_stream, worker.url) for _ in range(3)]
        # One runs, two wait for the slot: seconds of work left when the signal comes.
        wait_until(lambda: worker_status(worker.url)["num_accepted"] == 3, timeout_s=20,
                   what="three requests accepted")
        worker.terminate()
        wait_until(lambda: MODEL not in list_models(controller_url), timeout_s=5,
                   what="the worker deregistered")
        assert not all(s.done() for s in streams), "still serving after deregistering"
        wait_until(lambda: refused(worker.url), timeout_s=5, what="new connections refused")
        finals = [s.result(timeout=60) for s in streams]
        assert [f.get("finish_reason") for f in finals] == ["length"] * 3, finals
        assert all(f["usage"]["completion_tokens"] == LONG["max_new_tokens"] for f in finals)
        # The worker's own processes (the grammar compile processes' fork server, started at
        # startup) are gone with it.
        helpers = children_of(worker.pid)
        assert worker.wait(timeout=30) in STOPPED, worker.output()
    wait_until(lambda: not any(alive(pid) for pid in helpers), timeout_s=10, what="no orphans")
    assert "deregistered" in worker.output()


def test_worker_sigterm_cuts_what_outlasts_the_shutdown_timeout(controller_url, tiny_model_dir, tmp_path):
    worker = start_worker(tiny_model_dir, controller_url, tmp_path,
                          extra=["--limit-worker-concurrency", "1", "--shutdown-timeout", "1"])
    num = 8  # one slot, 480 tokens each: several seconds of queued work
    with services(worker), ThreadPoolExecutor(num) as pool:
        wait_for_models(controller_url, [MODEL])
        streams = [pool.submit(read_worker_stream, worker.url) for _ in range(num)]
        wait_until(lambda: worker_status(worker.url)["num_accepted"] >= num - 1, timeout_s=20,
                   what="requests queued")
        signalled = time.monotonic()
        worker.terminate()
        assert worker.wait(timeout=20) in STOPPED, worker.output()
        stopped_after = time.monotonic() - signalled
        finals = [s.result(timeout=30) for s in streams]  # every client gets an end, none hangs
    assert any("broken" in f for f in finals), "the rest was cut at the timeout"
    # 1 s of grace, then the lifespan shutdown (engine stop): far less than the queued work.
    assert stopped_after < 10, stopped_after


def test_controller_sigterm_lets_proxied_streams_finish(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    controller = start_service("llmplatform.controller", ["--port", str(port), "--shutdown-timeout", "30"],
                               tmp_path / "controller.log", f"{url}/health", url)
    llm = slowed(paged_tiny_llm(tiny_model_dir), 0.01)  # 480 steps: ~5 s
    with services(controller), serve_worker(worker_app(llm, url)), ThreadPoolExecutor(1) as pool:
        wait_for_models(url, [MODEL])
        first_chunk = threading.Event()

        def through_controller() -> dict[str, Any]:
            last: dict[str, Any] = {}
            with httpx.stream("POST", f"{url}/worker_generate_stream", json=LONG, timeout=60) as response:
                buffer = b""
                for data in response.iter_bytes():
                    buffer += data
                    *frames, buffer = buffer.split(b"\0")
                    for frame in frames:
                        last = json.loads(frame)
                        first_chunk.set()
            return last

        proxied: Future[dict[str, Any]] = pool.submit(through_controller)
        assert first_chunk.wait(30)
        controller.terminate()
        wait_until(lambda: refused(url), timeout_s=5, what="new connections refused")
        assert not proxied.done()
        final = proxied.result(timeout=60)
        assert final["finish_reason"] == "length" and final["error_code"] == 0
        assert controller.wait(timeout=30) in STOPPED, controller.output()


def test_gateway_sigterm_lets_streams_finish(tiny_model_dir, tmp_path, new_client):
    llm = slowed(paged_tiny_llm(tiny_model_dir), 0.01)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_in_thread(controller_app()) as controller_url, \
            serve_worker(worker_app(llm, controller_url)):
        wait_for_models(controller_url, [MODEL])
        gateway = start_service("llmplatform.openai_api",
                                ["--port", str(port), "--controller-address", controller_url,
                                 "--shutdown-timeout", "30"],
                                tmp_path / "gateway.log", f"{url}/health", url)
        with services(gateway), ThreadPoolExecutor(2) as pool:
            client = new_client(url)
            started = threading.Semaphore(0)

            def stream(i: int) -> list[Any]:
                chunks = []
                for chunk in client.completions.create(model=MODEL, prompt=f"Story {i}", max_tokens=400,
                                                       stream=True, extra_body={"ignore_eos": True},
                                                       stream_options={"include_usage": True}):
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        started.release()
                return chunks

            pending = [pool.submit(stream, i) for i in range(2)]
            for _ in pending:
                assert started.acquire(timeout=30)
            gateway.terminate()
            wait_until(lambda: refused(url), timeout_s=5, what="new connections refused")
            for future in pending:
                chunks = future.result(timeout=60)
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
                assert chunks[-1].usage.completion_tokens == 400
            assert gateway.wait(timeout=30) in STOPPED, gateway.output()


def test_serve_sigterm_drains_and_leaves_no_orphans(tiny_model_dir, tmp_path, new_client):
    controller_port, api_port, worker_port = free_port(), free_port(), free_port()
    worker_url = f"http://127.0.0.1:{worker_port}"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmplatform.cli", "serve", "--controller-port", str(controller_port),
         "--api-port", str(api_port), "--shutdown-timeout", "30", "--no-webui",
         "--worker", f"--model-path {tiny_model_dir} --model-names {MODEL} --port {worker_port} "
                     "--dtype float32 --backend paged --kv-cache-memory 64MiB --limit-worker-concurrency 1"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "LLMPLATFORM_CLUSTER_SECRET": "shutdown-test-secret"})  # to ask the worker
    inside = {"X-LLMPlatform-Secret": "shutdown-test-secret"}
    output = lambda: (tmp_path / "serve.log").read_text(errors="replace")[-4000:]  # noqa: E731
    children: list[int] = []
    try:
        api = f"http://127.0.0.1:{api_port}"
        wait_until(lambda: "OpenAI API at" in output() or proc.poll() is not None, timeout_s=180,
                   interval_s=0.2, what="serve started")
        assert proc.poll() is None, output()
        children = children_of(proc.pid)
        assert len(children) == 3, "controller, worker and gateway run as child processes"
        client = new_client(api, timeout=120)

        def stream(i: int) -> list[Any]:
            return list(client.completions.create(model=MODEL, prompt=f"Story {i}", max_tokens=480,
                                                  stream=True, extra_body={"ignore_eos": True}))

        with ThreadPoolExecutor(3) as pool:
            pending = [pool.submit(stream, i) for i in range(3)]
            wait_until(lambda: httpx.post(f"{worker_url}/worker_get_status", json={}, headers=inside,
                                          timeout=10).json()["num_accepted"] == 3, timeout_s=30,
                       what="three requests on the worker")
            proc.send_signal(signal.SIGTERM)
            for future in pending:
                chunks = future.result(timeout=120)
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert proc.wait(timeout=60) == 0, output()
        wait_until(lambda: not any(alive(c) for c in children), timeout_s=10, what="no orphans")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for child in children:  # only if the test failed: never leave them running
            if alive(child):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
        log.close()
