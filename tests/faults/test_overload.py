"""Overload: beyond its queue limit a worker refuses at once with 429 + Retry-After, and the
gateway tries another worker or passes the 429 on in OpenAI's envelope.

Two real paged workers (tiny model) with one concurrency slot and a queue of one each; engine
steps are slowed so that a long request holds its slot for many seconds. The controller (and the
gateway, which picks from its own copy of the worker list with the controller's method) draws
lottery tickets from a source that always returns 0, so it deterministically offers the worker
whose URL sorts first ("first"): the one these tests fill.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.routing.policies import DispatchMethod
from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import (
    MODEL, FirstCandidate, gateway_app, serve_worker, worker_app, worker_status,
)
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.polling import wait_until

STEP_DELAY_S = 0.03
RETRY_AFTER_S = 7
PARAMS = {"model": MODEL, "prompt": "Once upon a time", "max_new_tokens": 480, "temperature": 0,
          "ignore_eos": True, "echo": False}


def slowed(llm: Any) -> Any:
    runner = llm.engine.runner
    real_execute = runner.execute

    def slow_execute(scheduled: Any) -> Any:
        time.sleep(STEP_DELAY_S)
        return real_execute(scheduled)

    runner.execute = slow_execute
    return llm


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    config = ControllerConfig(dispatch_method=DispatchMethod.LOTTERY)
    settings = dict(limit_worker_concurrency=1, max_queue_len=1, retry_after=RETRY_AFTER_S)
    with contextlib.ExitStack() as stack:
        controller_url = stack.enter_context(serve_in_thread(
            create_controller_app(config, rng=FirstCandidate())))
        gateway = gateway_app(controller_url, rng=FirstCandidate())
        gateway_url = stack.enter_context(serve_in_thread(gateway))
        urls = [stack.enter_context(serve_worker(worker_app(
            slowed(paged_tiny_llm(tiny_model_dir)), controller_url, **settings))) for _ in range(2)]
        wait_for_models(controller_url, [MODEL])
        wait_until(lambda: worker_status(controller_url)["speed"] == 2, timeout_s=10,
                   what="both workers registered")  # the controller's aggregate: speeds summed
        # ... and both in the gateway's routing table (read once a second), so it ranks the pair.
        wait_until(lambda: len(gateway.state.routing_table.workers()) == 2, timeout_s=10,
                   what="both workers in the gateway's routing table")
        first, second = sorted(urls)
        yield {"gateway": gateway_url, "first": first, "second": second}


@contextlib.contextmanager
def filled(worker_url: str) -> Iterator[None]:
    """One long request running and one waiting on `worker_url` (its slot and queue are full);
    closing the streams at the end aborts both."""
    with httpx.Client(timeout=30) as http, contextlib.ExitStack() as streams:
        for num_accepted in (1, 2):
            response = streams.enter_context(
                http.stream("POST", f"{worker_url}/worker_generate_stream", json=PARAMS))
            assert response.status_code == 200
            # A request waits (and counts against the queue) until the engine runs it: the
            # second may only come once the first is running.
            wait_until(lambda n=num_accepted: _accepted_one_running(worker_url, n), timeout_s=10,
                       what=f"{num_accepted} request(s) accepted, one running")
        status = worker_status(worker_url)
        assert (status["num_slots_in_use"], status["num_running"]) == (1, 1)
        yield
    wait_until(lambda: worker_status(worker_url)["num_accepted"] == 0, timeout_s=10,
               what="the filling requests aborted")


def _accepted_one_running(worker_url: str, num_accepted: int) -> bool:
    status = worker_status(worker_url)
    return status["num_accepted"] == num_accepted and status["num_running"] == 1


def test_worker_refuses_beyond_its_queue_with_429_and_retry_after(cluster):
    worker = cluster["first"]
    with filled(worker):
        for route in ("/worker_generate_stream", "/worker_generate"):
            started = time.monotonic()
            refused = httpx.post(f"{worker}{route}", json=PARAMS, timeout=30)
            # At once: queued, it would wait behind two 480-token requests (~30 s).
            assert time.monotonic() - started < 10, "refused at once, not after queueing"
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
            body = refused.json()
            assert body["error_code"] == 42903 and "overloaded" in body["text"]
        assert worker_status(worker)["num_accepted"] == 2, "a refused request leaves no trace"
    short = dict(PARAMS, max_new_tokens=2)
    assert httpx.post(f"{worker}/worker_generate", json=short, timeout=30).json()["finish_reason"] == "length"


def test_gateway_tries_another_worker_when_the_first_is_full(cluster, new_client):
    client = new_client(cluster["gateway"])
    with filled(cluster["first"]):
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
            extra_body={"ignore_eos": True}))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_gateway_passes_429_on_when_every_worker_is_full(cluster, new_client):
    gateway = cluster["gateway"]
    client = new_client(gateway)
    with filled(cluster["first"]), filled(cluster["second"]):
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert time.monotonic() - started < 10, "answered at once, not queued"
        error = caught.value
        assert error.status_code == 429
        assert error.response.headers["retry-after"] == str(RETRY_AFTER_S)
        envelope = json.loads(error.response.content)
        assert set(envelope["error"]) == {"message", "type", "param", "code"}
        assert envelope["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):  # streaming too: a status, before any event
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, stream=True)
    # Freed again: served normally.
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].finish_reason
