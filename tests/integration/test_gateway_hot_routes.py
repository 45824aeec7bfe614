"""The two generation routes skip FastAPI's routing (openai_api/hot_routes.py), and their
streamed responses are sent by EventStreamResponse's own loop (openai_api/sse.py): the same
answers, keys, metrics and cleanup as every other route, over the fake-worker cluster."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRouter

from tests.integration.fake_worker import (  # noqa: F401  (cluster, http: fixtures)
    API_KEY,
    FULL_REPLY,
    MODEL,
    Cluster,
    cluster,
    http,
)
from tests.polling import wait_until

HOT = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture
def routed_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths that went through a FastAPI router while the test ran (every app in this process)."""
    seen: list[str] = []
    real_call = APIRouter.__call__

    async def spy(self: APIRouter, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope["path"])
        await real_call(self, scope, receive, send)

    monkeypatch.setattr(APIRouter, "__call__", spy)
    return seen


def _sse_texts(body: str) -> list[str]:
    return [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]


def test_generation_routes_bypass_fastapi_routing_and_others_do_not(
        http: httpx.Client, routed_paths: list[str]) -> None:
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 20})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == FULL_REPLY
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                    "messages": [{"role": "user", "content": "Say hi"}]})
    assert chat.status_code == 200 and chat.headers["content-type"].startswith("text/event-stream")
    assert _sse_texts(chat.text)[-1] == "[DONE]"
    assert http.get("/v1/models").status_code == 200
    assert "/v1/models" in routed_paths  # the spy sees what FastAPI routes...
    assert not set(HOT) & set(routed_paths)  # ...and the generation routes never reach it


def test_other_methods_on_the_hot_paths_are_fastapis(http: httpx.Client) -> None:
    for path in HOT:
        response = http.get(path)
        assert response.status_code == 405, path
        assert response.json()["error"]["message"] == "Method Not Allowed"


@pytest.mark.parametrize("path", HOT)
def test_hot_routes_keep_the_key_check_and_the_envelope(cluster: Cluster, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    missing = httpx.post(f"{cluster.gateway}{path}", json=body, timeout=20)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    bad = httpx.post(f"{cluster.gateway}{path}", content=b"{not json", headers=headers, timeout=20)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    unknown = httpx.post(f"{cluster.gateway}{path}", json={**body, "model": "nope"}, headers=headers, timeout=20)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def _completions_200(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if (line.startswith("llmplatform:gateway_requests_total{")
                and 'route="/v1/completions"' in line and 'status="200"' in line and f'model="{MODEL}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_errors() -> Iterator[_Records]:
    """Error records of uvicorn's loggers, which do not propagate to the root (caplog's)."""
    records = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)


def test_a_client_leaving_mid_stream_ends_the_request_cleanly(
        cluster: Cluster, http: httpx.Client, caplog: pytest.LogCaptureFixture, server_errors: _Records) -> None:
    """The worker's stream is stopped at once (left alone it would run 3 s), the exchange is
    counted as a 200 (the response had started), and nothing is logged as an error: the
    disconnect is not an exception."""
    before = _completions_200(http)
    request_id = "hot-leave-1"
    with httpx.Client(base_url=cluster.gateway, timeout=20,
                      headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": request_id}) as leaving:
        with leaving.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "SLOW", "stream": True,
                                                              "max_tokens": 60}) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first event, then leave with the stream open
    worker_request = next(p["request_id"] for p in reversed(cluster.worker.params)
                          if p["request_id"].startswith(f"{request_id}-"))
    # Run to its end, the fake's stream would count as finished, never as stopped.
    wait_until(lambda: cluster.worker.stopped(worker_request), what="the worker's stream stopped")
    wait_until(lambda: _completions_200(http) >= before + 1, what="the exchange counted")
    assert _completions_200(http) == before + 1
    time.sleep(0.3)  # what the server would log after that (uvicorn's "Exception in ASGI application")
    errors = [r.getMessage() for r in [*caplog.records, *server_errors.records] if r.levelno >= logging.ERROR]
    assert not errors
