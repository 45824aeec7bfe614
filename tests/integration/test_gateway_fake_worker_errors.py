"""The gateway end to end over fake workers: error mapping and client disconnects
(tests/integration/fake_worker.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from llmplatform.openai_api import GatewaySettings, create_app
from llmplatform.utils.server import serve_in_thread
from tests.integration.fake_worker import (  # noqa: F401  (cluster, client, http: fixtures)
    API_KEY,
    CONTEXT_LENGTH,
    DEAD_MODEL,
    GONE_MODEL,
    MODEL,
    USER,
    Cluster,
    client,
    cluster,
    http,
    register_worker,
)
from tests.polling import wait_until


# ---- errors ----------------------------------------------------------------------------------------


def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", b"[]", 400, None),
    ("/v1/chat/completions", {"messages": USER}, 400, "model"),
    ("/v1/chat/completions", _chat_body(messages=[]), 400, "messages"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("/v1/chat/completions", _chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    (
        "/v1/chat/completions",
        _chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages[0].content[0].type",
    ),
    ("/v1/chat/completions", _chat_body(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", _chat_body(max_tokens=-1), 400, "max_tokens"),
    ("/v1/chat/completions", _chat_body(max_tokens="ten"), 400, "max_tokens"),
    ("/v1/chat/completions", _chat_body(temperature=3), 400, "temperature"),
    ("/v1/chat/completions", _chat_body(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", _chat_body(n=0), 400, "n"),
    ("/v1/chat/completions", _chat_body(n=1000), 400, "n"),
    ("/v1/chat/completions", _chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat_body(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat_body(model=123), 400, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests(http: httpx.Client, path: str, body: Any, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    # The server keeps serving.
    ok = http.post("/v1/chat/completions", json=_chat_body(max_tokens=1))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello"


def _assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow(http: httpx.Client, stream: bool) -> None:
    response = http.post("/v1/chat/completions", json=_chat_body(max_tokens=CONTEXT_LENGTH, stream=stream))
    error = _assert_error(response, 400, "context_length_exceeded")
    assert f"maximum context length is {CONTEXT_LENGTH} tokens" in error["message"]
    long_messages = [{"role": "user", "content": "word " * CONTEXT_LENGTH}]
    response = http.post("/v1/chat/completions", json=_chat_body(messages=long_messages, stream=stream))
    _assert_error(response, 400, "context_length_exceeded")
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": CONTEXT_LENGTH, "stream": stream}
    )
    _assert_error(response, 400, "context_length_exceeded")
    assert http.post("/v1/chat/completions", json=_chat_body(max_tokens=1)).status_code == 200


def test_unknown_model_is_404(http: httpx.Client, client: openai.OpenAI) -> None:
    _assert_error(http.post("/v1/chat/completions", json=_chat_body(model="nope")), 404, "model_not_found")
    _assert_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)


def test_unreachable_worker_is_503(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=_chat_body(model=DEAD_MODEL))
    assert _assert_error(response, 503)["type"] == "service_unavailable"


def test_model_without_live_worker_is_503(http: httpx.Client, cluster: Cluster) -> None:
    assert http.post("/v1/chat/completions", json=_chat_body(model=GONE_MODEL, max_tokens=1)).status_code == 200
    cluster.controller_app.state.registry.remove(cluster.gone_worker_url)
    # The gateway routes from its copy of the worker list: the worker is out of it with the next
    # read (every second by default).
    table = cluster.gateway_app.state.routing_table
    wait_until(lambda: GONE_MODEL not in table.models(), what="the gone worker out of the gateway's table")
    response = http.post("/v1/chat/completions", json=_chat_body(model=GONE_MODEL, stream=True))
    assert _assert_error(response, 503)["type"] == "service_unavailable"
    register_worker(cluster.controller, cluster.gone_worker_url, [GONE_MODEL])
    assert http.post("/v1/chat/completions", json=_chat_body(model=GONE_MODEL, max_tokens=1)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_worker_error_before_output_is_an_http_status(http: httpx.Client, stream: bool) -> None:
    body = _chat_body(messages=[{"role": "user", "content": "FAIL_EARLY"}], stream=stream, n=2)
    error = _assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["message"] == "the fake worker refuses"


def test_worker_error_mid_stream_is_an_sse_error(http: httpx.Client) -> None:
    body = _chat_body(messages=[{"role": "user", "content": "FAIL_LATE"}], stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["message"] == "the fake worker broke" and error["type"] == "internal_error"
    # Non-streamed, the same failure is a 500 envelope, and the server still serves.
    body["stream"] = False
    _assert_error(http.post("/v1/chat/completions", json=body), 500)
    assert http.post("/v1/chat/completions", json=_chat_body(max_tokens=1)).status_code == 200


def test_silent_worker_is_504(cluster: Cluster) -> None:
    settings = GatewaySettings(controller_address=cluster.controller, worker_timeout=0.3)
    with serve_in_thread(create_app(settings)) as impatient:
        body = _chat_body(messages=[{"role": "user", "content": "HANG"}])
        for stream in (False, True):
            response = httpx.post(f"{impatient}/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
            assert _assert_error(response, 504)["type"] == "timeout"
        assert httpx.post(f"{impatient}/v1/chat/completions", json=_chat_body(max_tokens=1)).status_code == 200


def test_unexpected_error_is_a_500_envelope(http: httpx.Client, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(cluster.gateway_app.state.worker_client, "model_details", broken)
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert _assert_error(response, 500)["type"] == "internal_error"
    monkeypatch.undo()
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_cors_preflight(cluster: Cluster) -> None:
    # CORS is off by default (tests/security covers that); here it is configured.
    settings = GatewaySettings(controller_address=cluster.controller, allowed_origins=("http://example.com",))
    with serve_in_thread(create_app(settings)) as gateway:
        response = httpx.options(
            f"{gateway}/v1/chat/completions",
            headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
        )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://example.com"


def test_unknown_route_and_method_use_the_envelope(http: httpx.Client) -> None:
    _assert_error(http.get("/v1/nothing-here"), 404)
    _assert_error(http.get("/v1/chat/completions"), 405)


# ---- disconnects -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_worker(cluster: Cluster, stream: bool) -> None:
    body = _chat_body(messages=[{"role": "user", "content": "SLOW"}], stream=stream, n=2)
    before = len(cluster.worker.params)
    with httpx.Client(base_url=cluster.gateway, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
            # Leaving the block closes the connection mid-stream.
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body, timeout=0.5)
    wait_until(lambda: len(cluster.worker.params) >= before + 2, what="both choices sent to the worker")
    request_ids = [p["request_id"] for p in cluster.worker.params[before:]]
    assert len(request_ids) == 2
    # Both choices' streams end early: closing them is how the gateway aborts (no /worker_abort).
    wait_until(lambda: all(r in cluster.worker.closed_early for r in request_ids),
               what=f"the streams of {request_ids} closed early", context=lambda: cluster.worker.closed_early)
