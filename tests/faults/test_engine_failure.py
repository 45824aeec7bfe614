"""An engine step that fails as a whole: no zombie.

The worker runs as a real service (`python -m llmplatform.model_worker`, paged tiny model) with
the test-only fault injection (tests/faults/faulty_runner.py, the worker started through
`tests.faults.faulty_worker`): a step that schedules a request whose
prompt carries STEP_MARK raises in the forward pass, exactly where a CUDA error or a bug in the
model would. The controller and the gateway are in-process servers.

- The requests in flight end with an error (never a hang), the engine is rebuilt in-process,
  the worker serves again within seconds (and stays registered), and
  `llmplatform:engine_restarts_total` counts the restart.
- When the engine cannot be rebuilt, or fails more often than the restart bound allows, the
  worker process exits non-zero, so that a supervisor starts a fresh one.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from llmplatform.utils.server import serve_in_thread
from tests.faults.faulty_runner import Faults
from tests.faults.harness import MODEL, Service, controller_app, gateway_app, services, start_worker
from tests.integration.cluster import wait_for_models
from tests.polling import wait_until

STEP_MARK = "zebra-step-fault"
SERVING_AGAIN_WITHIN_S = 10.0
LONG = {"max_tokens": 480, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def front():
    with serve_in_thread(controller_app()) as controller_url, \
            serve_in_thread(gateway_app(controller_url)) as gateway_url:
        yield controller_url, gateway_url


def faulty_worker(model_dir: Path, controller_url: str, log_dir: Path, **faults: object) -> Service:
    return start_worker(model_dir, controller_url, log_dir,
                        faults=Faults(step_marker=STEP_MARK, **faults))


def generate_direct(worker_url: str, prompt: str, max_new_tokens: int) -> dict:
    """The last object of a worker stream (FastChat protocol, straight to the worker)."""
    reply = httpx.post(f"{worker_url}/worker_generate_stream", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0,
        "ignore_eos": True})
    return json.loads([part for part in reply.content.split(b"\0") if part][-1])


def restarts(worker_url: str) -> float:
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    found = re.search(r'^llmplatform:engine_restarts_total\{model_name="tiny"\} (\S+)$', text, re.M)
    assert found, text
    return float(found.group(1))


def test_a_failed_step_restarts_the_engine_and_the_worker_serves_again(
        tiny_model_dir, tmp_path, front, new_client):
    controller_url, gateway_url = front
    with services(faulty_worker(tiny_model_dir, controller_url, tmp_path)) as (worker,):
        wait_for_models(controller_url, [MODEL])
        client = new_client(gateway_url, timeout=60)
        assert restarts(worker.url) == 0
        expected = client.completions.create(model=MODEL, prompt="Once", max_tokens=8,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(2) as pool:
            # Two long requests in flight: a streamed chat through the gateway, and one straight
            # to the worker, whose error text the test can read as the worker wrote it.
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, **LONG)
            assert next(iter(stream)).choices[0].delta.role == "assistant"
            direct = pool.submit(generate_direct, worker.url, "Hello", 480)
            wait_until(lambda: httpx.post(f"{worker.url}/worker_get_status", timeout=5)
                       .json()["num_running"] == 2, timeout_s=30, what="two requests running")

            with pytest.raises(openai.APIError):  # the request whose step failed
                client.completions.create(model=MODEL, prompt=f"Go {STEP_MARK}", max_tokens=4)
            failed_at = time.monotonic()

            with pytest.raises(openai.APIError):  # the stream ends with an error, not a hang
                for _ in stream:
                    pass
            error = direct.result(timeout=60)
            assert error["error_code"] == 50001
            assert "injected fault: the forward pass failed" in error["text"]
            assert "restarting; retry the request" in error["text"]

        # Serving again within seconds: /health, then a real request through the gateway (the
        # worker stayed registered).
        wait_until(lambda: httpx.get(worker.health_url, timeout=5).status_code == 200,
                   timeout_s=SERVING_AGAIN_WITHIN_S, what="the worker healthy again")
        remaining_s = max(1.0, SERVING_AGAIN_WITHIN_S - (time.monotonic() - failed_at))
        answer = new_client(gateway_url, timeout=remaining_s).completions.create(
            model=MODEL, prompt="Once", max_tokens=8, temperature=0)
        assert answer.choices[0].text == expected
        assert restarts(worker.url) == 1
        assert worker.proc.poll() is None
        log = worker.output()
        assert re.search(r"ERROR.*engine step failed \(InjectedFault.*restarting the engine", log), log


@pytest.mark.parametrize("case", ["the rebuild fails", "too many restarts in a minute"])
def test_an_engine_that_cannot_recover_makes_the_worker_exit_non_zero(
        tiny_model_dir, tmp_path, front, case):
    controller_url, _ = front
    worker_service = faulty_worker(tiny_model_dir, controller_url, tmp_path,
                                   fail_rebuild=case == "the rebuild fails")
    with services(worker_service) as (worker,):
        wait_for_models(controller_url, [MODEL])
        # RestartConfig's default bound: 3 restarts within a minute; the 4th failure is final.
        num_failures = 1 if case == "the rebuild fails" else 4
        for i in range(num_failures):
            error = generate_direct(worker.url, f"Go {STEP_MARK}", 4)
            assert "injected fault: the forward pass failed" in error["text"]
            if i < num_failures - 1:
                wait_until(lambda: httpx.get(worker.health_url, timeout=5).status_code == 200,
                           timeout_s=SERVING_AGAIN_WITHIN_S, what="the worker healthy again")
        assert worker.wait(timeout=60) == 1
        log = worker.output()
        assert "exiting with status 1" in log, log
        expected_reason = "could not be rebuilt" if case == "the rebuild fails" else "3 restart(s)"
        assert expected_reason in log, log
        # It left the controller on the way out, so nothing is routed to it any more.
        wait_until(lambda: MODEL not in httpx.post(f"{controller_url}/list_models", timeout=5)
                   .json()["models"], timeout_s=10, what="the worker deregistered")
