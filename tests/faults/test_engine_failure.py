"""An engine step that raises: in-flight requests end with an error (never hang), the worker's
/health answers 503, new work is refused at once with 503, and the worker leaves the controller
so the gateway stops routing to it.

The fault is injected into the real engine of an in-process paged worker (tiny model): the
model runner's `execute` raises once a flag is set, on the engine's step thread, exactly where
a CUDA error or a bug in the forward pass would surface.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import (
    MODEL, controller_app, gateway_app, list_models, serve_worker, wait_until, worker_app,
)
from tests.integration.cluster import paged_tiny_llm, wait_for_models

STEP_DELAY_S = 0.02


@pytest.fixture
def cluster(tiny_model_dir):
    llm = paged_tiny_llm(tiny_model_dir)
    runner = llm.engine.runner
    real_execute = runner.execute
    fail = threading.Event()

    def faulty_execute(scheduled: Any) -> Any:
        time.sleep(STEP_DELAY_S)  # keeps the requests in flight until the fault is injected
        if fail.is_set():
            raise RuntimeError("injected fault: the forward pass failed")
        return real_execute(scheduled)

    runner.execute = faulty_execute
    with serve_in_thread(controller_app()) as controller_url, \
            serve_in_thread(gateway_app(controller_url)) as gateway_url, \
            serve_worker(worker_app(llm, controller_url)) as worker_url:
        wait_for_models(controller_url, [MODEL])
        yield {"gateway": gateway_url, "worker": worker_url, "controller": controller_url,
               "fail": fail}


def raw_events(gateway_url: str, started: threading.Event) -> list[bytes]:
    """A streamed completion read as raw SSE lines, until the server ends the stream."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                lines.append(line.encode())
                started.set()
    return lines


def test_engine_step_that_raises(cluster, new_client):
    gateway, worker = cluster["gateway"], cluster["worker"]
    client = new_client(gateway, timeout=30)
    raw_started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        raw = pool.submit(raw_events, gateway, raw_started)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=400, stream=True,
            extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        assert raw_started.wait(30)
        non_streamed = pool.submit(lambda: httpx.post(
            f"{gateway}/v1/completions", timeout=30,
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}))
        wait_until(lambda: httpx.post(f"{worker}/worker_get_status").json()["num_running"] == 3,
                   timeout=10, what="three requests running")

        cluster["fail"].set()

        # The streamed chat request ends with an error event (the official client raises it),
        # not a hang and not a silent, truncated "success".
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
        assert "engine" in str(caught.value.message).lower()
        # On the wire: one error event in OpenAI's envelope, then [DONE], then the end.
        lines = raw.result(timeout=30)
        assert lines[-1] == b"data: [DONE]"
        error = json.loads(lines[-2].removeprefix(b"data: "))
        assert set(error["error"]) == {"message", "type", "param", "code"}
        # The non-streamed request: an error envelope with its status.
        reply = non_streamed.result(timeout=30)
        assert reply.status_code >= 500 and set(reply.json()["error"]) == {"message", "type", "param", "code"}

    # The worker says it cannot serve, and refuses new work at once with an HTTP status.
    assert httpx.get(f"{worker}/health", timeout=5).status_code == 503
    refused = httpx.post(f"{worker}/worker_generate_stream", timeout=5,
                         json={"model": MODEL, "prompt": "Hi", "max_new_tokens": 4})
    assert refused.status_code == 503 and refused.json()["error_code"]
    status = httpx.post(f"{worker}/worker_get_status", timeout=5).json()
    assert status["num_accepted"] == 0 and status["num_slots_in_use"] == 0

    # It leaves the controller (within a heartbeat), so the gateway stops sending it work.
    wait_until(lambda: MODEL not in list_models(cluster["controller"]), timeout=5,
               what="the dead worker deregistered")
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert unavailable.value.status_code == 503
