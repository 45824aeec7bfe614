"""A worker process killed (SIGKILL: the kernel cuts its sockets, nothing of it runs any more).

Before the first byte of its answer, the gateway retries another worker serving the model and
the client sees a normal answer. Mid-stream, the client gets an SSE error event in OpenAI's
envelope followed by `data: [DONE]`; a non-streamed request gets a 502/503 envelope. Nothing
hangs: every client call has a timeout far above what the answer needs.

Workers run as `python -m llmplatform.model_worker` subprocesses; the controller and the gateway
are in-process uvicorn servers. The controller draws lottery tickets from a source that always
returns 0, so it offers the worker whose URL sorts first, the one a test kills; the gateway, which
picks from its own copy of the worker list with the controller's method, draws from one too.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.routing.policies import DispatchMethod
from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import MODEL, FirstCandidate, gateway_app, services, start_worker, worker_status
from tests.integration.cluster import wait_for_models
from tests.polling import wait_until

@pytest.fixture
def front():
    """Controller (expiry 60 s: a killed worker stays listed while the test runs) and gateway."""
    config = ControllerConfig(dispatch_method=DispatchMethod.LOTTERY, heartbeat_expiration=60.0)
    with serve_in_thread(create_controller_app(config, rng=FirstCandidate())) as controller_url:
        gateway = gateway_app(controller_url, rng=FirstCandidate())
        with serve_in_thread(gateway) as gateway_url:
            _gateways[gateway_url] = gateway
            yield controller_url, gateway_url
            del _gateways[gateway_url]


_gateways: dict[str, Any] = {}


def registered(controller_url: str, n: int) -> None:
    """n workers known to the controller and to every gateway's routing table (which reads the
    controller's list once a second: a request sent before that could only see the first one)."""
    wait_for_models(controller_url, [MODEL])
    wait_until(lambda: worker_status(controller_url)["speed"] == n, timeout_s=20,
               what=f"{n} workers registered")
    for app in _gateways.values():
        wait_until(lambda: len(app.state.routing_table.workers()) == n, timeout_s=20,
                   what=f"{n} workers in the gateway's routing table")


def unread_request_bytes(port: int) -> int:
    """Bytes the kernel has received on established connections to `port` that the process
    listening there has not read (/proc/net/tcp's rx_queue)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        if local_port == port and fields[3] == "01":  # ESTABLISHED
            total += int(fields[4].split(":")[1], 16)
    return total


def test_worker_killed_before_first_byte_is_retried_on_another(front, tiny_model_dir, tmp_path, new_client):
    controller_url, gateway_url = front
    with services(start_worker(tiny_model_dir, controller_url, tmp_path, name="a"),
                  start_worker(tiny_model_dir, controller_url, tmp_path, name="b")) as workers:
        registered(controller_url, 2)
        first, second = sorted(workers, key=lambda w: w.url)
        client = new_client(gateway_url)

        # The first worker hangs (SIGSTOP): the kernel still accepts the gateway's connection
        # and holds its request bytes, unread ...
        os.kill(first.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                stream=True, extra_body={"ignore_eos": True})))
            wait_until(lambda: unread_request_bytes(int(first.url.rsplit(":", 1)[1])) > 0,
                       timeout_s=20, what="the gateway's request waiting on the first worker")
            # ... and dies before answering a byte: the kernel resets the connection.
            first.kill()
            chunks = pending.result(timeout=60)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert text, "a normal answer, served by the second worker"

        # The dead worker is still listed (it has not expired yet): connections to it are
        # refused, and the gateway goes on to the live one, streamed or not.
        assert httpx.post(f"{controller_url}/get_worker_address",
                          json={"model": MODEL}).json()["address"] == first.url
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
        streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                                  stream=True, extra_body={"ignore_eos": True}))
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
        assert worker_status(second.url)["num_accepted"] == 0


def raw_stream(gateway_url: str, started: threading.Event) -> list[bytes]:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 480, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                lines.append(line.encode())
                if len(lines) >= 2:
                    started.set()
    return lines


def test_worker_killed_mid_stream_ends_with_error_event_and_done(front, tiny_model_dir, tmp_path,
                                                                  new_client):
    controller_url, gateway_url = front
    with services(start_worker(tiny_model_dir, controller_url, tmp_path)) as (worker,):
        registered(controller_url, 1)
        client = new_client(gateway_url)
        raw_started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            raw = pool.submit(raw_stream, gateway_url, raw_started)
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=480,
                stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            for _ in range(3):
                next(chunks)
            assert raw_started.wait(60)
            worker.kill()
            # The official client raises the error event; it does not hang or end "normally".
            with pytest.raises(openai.APIError) as caught:
                for _ in chunks:
                    pass
            assert "stopped in the middle" in str(caught.value.message)
            lines = raw.result(timeout=60)
        assert lines[-1] == b"data: [DONE]", "the stream is closed properly after the error"
        error = json.loads(lines[-2].removeprefix(b"data: "))
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["type"] == "api_error"
        deltas = [json.loads(line.removeprefix(b"data: ")) for line in lines[:-2]]
        assert all(d["choices"][0]["finish_reason"] is None for d in deltas if d["choices"]), \
            "no chunk pretends the answer finished"


def test_worker_killed_during_a_non_streamed_request(front, tiny_model_dir, tmp_path):
    controller_url, gateway_url = front
    with services(start_worker(tiny_model_dir, controller_url, tmp_path)) as (worker,):
        registered(controller_url, 1)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: httpx.post(
                f"{gateway_url}/v1/completions", timeout=60,
                json={"model": MODEL, "prompt": "Once", "max_tokens": 480, "ignore_eos": True}))
            wait_until(lambda: _running(worker.url), timeout_s=30, what="the request running")
            worker.kill()
            reply = pending.result(timeout=60)
        assert reply.status_code in (502, 503)
        envelope = reply.json()
        assert set(envelope["error"]) == {"message", "type", "param", "code"}
        # The gateway keeps serving: with no live worker left it says so, at once.
        again = httpx.post(f"{gateway_url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["type"] == "service_unavailable"


def _running(worker_url: str) -> Any:
    try:
        return worker_status(worker_url)["num_running"] == 1
    except httpx.HTTPError:
        return False
