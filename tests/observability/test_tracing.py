"""Request ids on a real cluster (paged backend, real tiny weights): the gateway adopts a safe
X-Request-Id or makes one, returns it (errors included), and every log line about the request,
in the gateway, the worker and the engine, carries it."""

from __future__ import annotations

import json
import logging
import re
import threading

import httpx
import pytest

from tests.integration.cluster import paged_tiny_llm, running_cluster
from tests.polling import wait_until

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    llm = paged_tiny_llm(tiny_model_dir)
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.openai_client()


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="llmplatform")
    return caplog


def _ids(caplog, logger: str, message: str) -> list[str]:
    return [getattr(r, "request_id", None) for r in caplog.records
            if r.name == logger and message in r.getMessage()]


def _wait_for_log(caplog, logger: str, message: str, count: int = 1) -> None:
    """Waits (bounded) until ``count`` such lines were captured."""
    # Both log a request's end as its stream closes, just after the client has the answer.
    wait_until(lambda: len(_ids(caplog, logger, message)) >= count,
               what=f"{count} {message!r} line(s) from {logger} in the captured logs")


def test_client_id_is_echoed_and_on_every_log_line_about_the_request(client, logs):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0,
        extra_headers={"X-Request-Id": "trace-abc.1"})
    assert raw.headers["x-request-id"] == "trace-abc.1"
    assert raw.parse().choices[0].message.content is not None
    _wait_for_log(logs, "llmplatform.worker", "finished")
    _wait_for_log(logs, "llmplatform.openai_api.access", "POST /v1/chat/completions")

    assert _ids(logs, "llmplatform.openai_api.access", "POST /v1/chat/completions") == ["trace-abc.1"]
    # The worker and engine lines name the generation: <id>-<random>-<choice>.
    (worker_id,) = _ids(logs, "llmplatform.worker", "finished")
    assert re.fullmatch(r"trace-abc\.1-[0-9a-f]{8}-0", worker_id)
    assert _ids(logs, "llmplatform.engine", "queued") == [worker_id]
    # Nothing logged about the request lacks its id.
    about_it = [r for r in logs.records if r.name.startswith("llmplatform.")
                and ("finished" in r.getMessage() or "queued" in r.getMessage()
                     or "/v1/chat/completions" in r.getMessage())]
    assert about_it and all((r.request_id or "").startswith("trace-abc.1") for r in about_it)


def test_without_a_header_the_gateway_makes_an_id_and_uses_it_downstream(client, logs):
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Hello", max_tokens=3)
    request_id = raw.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    _wait_for_log(logs, "llmplatform.worker", "finished")
    assert _ids(logs, "llmplatform.worker", "finished") == [f"{request_id}-0"]


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "semi;colon", "ünï"])
def test_an_unsafe_client_id_is_replaced(cluster, bad):
    response = httpx.post(f"{cluster.gateway_url}/v1/completions",
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                          headers={"X-Request-Id": bad.encode("utf-8")}, timeout=30)
    assert response.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


@pytest.mark.parametrize("body, status", [
    ({"model": "no-such-model", "prompt": "Hi"}, 404),
    ({"model": "tiny", "prompt": "Hi", "max_tokens": -1}, 400),
    (b"{not json", 400),
])
def test_errors_carry_the_id_too(cluster, logs, body, status):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{cluster.gateway_url}/v1/completions", timeout=30,
                          headers={"X-Request-Id": "err-42", "Content-Type": "application/json"},
                          **kwargs)
    assert response.status_code == status
    assert response.headers["x-request-id"] == "err-42"
    assert set(response.json()["error"]) >= {"message", "type", "param", "code"}
    _wait_for_log(logs, "llmplatform.openai_api.access", "POST /v1/completions")
    assert _ids(logs, "llmplatform.openai_api.access", "POST /v1/completions") == ["err-42"]


def test_n_choices_are_one_worker_request_with_the_clients_id(client, logs):
    # The paged worker lists `n`: both choices are one worker request (one prefill), named
    # after the client's id and the first choice it carries.
    reply = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2,
                                      extra_headers={"X-Request-Id": "multi"})
    assert [c.index for c in reply.choices] == [0, 1]
    _wait_for_log(logs, "llmplatform.worker", "finished", count=1)
    ids = _ids(logs, "llmplatform.worker", "finished")
    prefix = ids[0].rsplit("-", 1)[0]
    assert prefix.startswith("multi-") and ids == [f"{prefix}-0"]


def test_a_reused_client_id_never_collides(client):
    # Clients reuse ids (retries): two requests with one id run side by side without clashing.
    results: list[str] = []

    def run() -> None:
        done = client.completions.create(model="tiny", prompt="Hi", max_tokens=24,
                                         extra_headers={"X-Request-Id": "same"},
                                         extra_body={"ignore_eos": True})
        results.append(done.choices[0].finish_reason)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == ["length"] * 3


def test_a_worker_refuses_a_running_request_id(cluster):
    url = f"{cluster.worker_urls['tiny']}/worker_generate_stream"
    params = {"model": "tiny", "prompt": "Hi", "max_new_tokens": 400, "ignore_eos": True,
              "request_id": "dup-1", "echo": False}
    with httpx.stream("POST", url, json=params, timeout=60) as first:
        chunks = first.iter_bytes()  # kept: dropping the iterator would close the stream
        next(chunks)  # running now
        second = httpx.post(url, json=params, timeout=30)
        chunk = json.loads(second.content.rstrip(b"\0"))
        assert chunk["error_code"] == 40302 and "already in use" in chunk["text"]  # a 400
