"""Every /v1 route, the generation routes included, is served by the one /v1 router
(openai_api/router.py): its dependencies run for each, the same keys, envelope and metrics hold,
and streamed responses (openai_api/sse.py's EventStreamResponse) clean up like any other. Over the
fake-worker cluster."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import Request

from llmplatform.openai_api.auth import require_api_key
from llmplatform.openai_api.errors import PermissionDeniedError
from tests.integration.fake_worker import (  # noqa: F401  (cluster, http: fixtures)
    API_KEY,
    FULL_REPLY,
    MODEL,
    Cluster,
    cluster,
    http,
)
from tests.polling import wait_until

GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture
def v1_dependency_calls(cluster: Cluster) -> Iterator[list[str]]:
    """The paths for which the /v1 router's dependency ran while the test did: the key check is
    replaced, through FastAPI's documented ``dependency_overrides``, by one that records and
    then checks. A route served by anything but the /v1 router never reaches the override."""
    calls: list[str] = []

    async def recording(request: Request) -> None:
        calls.append(request.url.path)
        await require_api_key(request)

    overrides = cluster.gateway_app.dependency_overrides
    overrides[require_api_key] = recording
    try:
        yield calls
    finally:
        del overrides[require_api_key]


def _sse_texts(body: str) -> list[str]:
    return [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_the_v1_routers_dependencies_run_for_generation_and_models(
        http: httpx.Client, v1_dependency_calls: list[str], stream: bool) -> None:
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Say hi", "max_tokens": 20,
                                                    "stream": stream})
    assert completion.status_code == 200
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "stream": stream,
                                                    "messages": [{"role": "user", "content": "Say hi"}]})
    assert chat.status_code == 200
    if stream:
        assert chat.headers["content-type"].startswith("text/event-stream")
        assert _sse_texts(chat.text)[-1] == "[DONE]"
    else:
        assert completion.json()["choices"][0]["text"] == FULL_REPLY
    assert http.get("/v1/models").status_code == 200
    assert v1_dependency_calls == ["/v1/completions", "/v1/chat/completions", "/v1/models"]


def test_what_the_v1_dependency_refuses_never_reaches_a_v1_handler(
        cluster: Cluster, http: httpx.Client) -> None:
    """Every /v1 route the app lists (its OpenAPI schema; the admin router has its own key
    check) answers with what the router's dependency raises, and no worker is asked: a route
    added beside the /v1 router instead of through it fails here."""

    async def refuse(request: Request) -> None:
        raise PermissionDeniedError("refused by the /v1 router")

    schema_paths: dict[str, dict[str, Any]] = cluster.gateway_app.openapi()["paths"]
    v1 = {path: methods for path, methods in schema_paths.items()
          if path.startswith("/v1/") and not path.startswith("/v1/admin/")}
    assert set(v1) >= {*GENERATION, "/v1/models"}
    before = len(cluster.worker.params)
    overrides = cluster.gateway_app.dependency_overrides
    overrides[require_api_key] = refuse
    try:
        for template, methods in v1.items():
            path = template.replace("{model}", MODEL)
            for method in methods:
                body: dict[str, Any] = {"model": MODEL, "prompt": "x", "input": "x",
                                        "messages": [{"role": "user", "content": "x"}]}
                response = http.request(method.upper(), path, json=body if method != "get" else None)
                assert response.status_code == 403, (method, path)
                assert response.json()["error"]["message"] == "refused by the /v1 router"
    finally:
        del overrides[require_api_key]
    assert len(cluster.worker.params) == before


def test_other_methods_on_the_generation_paths_are_405(http: httpx.Client) -> None:
    for path in GENERATION:
        response = http.get(path)
        assert response.status_code == 405, path
        assert response.json()["error"]["message"] == "Method Not Allowed"


@pytest.mark.parametrize("path", GENERATION)
def test_generation_routes_keep_the_key_check_and_the_envelope(cluster: Cluster, path: str) -> None:
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
    request_id = "router-leave-1"
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
