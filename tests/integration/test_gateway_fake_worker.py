"""The gateway end to end: a real controller, fake workers, real uvicorn servers, the openai client.

The fake worker speaks the worker protocol with deterministic output, so this file tests the
gateway's logic (routing, translation, streaming, errors, aborts); the real worker has its own
tests with real weights.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.openai_api import GatewaySettings, create_app
from llmplatform.protocol.worker import WorkerParams
from llmplatform.utils.server import serve_in_thread

MODEL = "fake-model"
STOCK_MODEL = "stock-model"
GONE_MODEL = "gone-model"
DEAD_MODEL = "dead-model"
API_KEY = "sk-test-key"
CONTEXT_LENGTH = 64
REPLY = ["Hello", ",", " caf", "é", " from", " the", " fake", " worker", "."]
"""What the fake model says, token by token; "é" first arrives as half a character."""

CHATML_CONV = {
    "name": "chatml",
    "system_template": "<|im_start|>system\n{system_message}",
    "system_message": "You are a fake.",
    "roles": ["<|im_start|>user", "<|im_start|>assistant"],
    "messages": [],
    "offset": 0,
    "sep_style": 9,
    "sep": "<|im_end|>",
    "sep2": None,
    "stop_str": "<|im_end|>",
    "stop_token_ids": [7],
}


def count_tokens(text: str) -> int:
    return len(text.split())


@dataclass
class FakeWorkerState:
    params: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    """request_ids from /worker_abort."""
    closed_early: list[str] = field(default_factory=list)
    """request_ids whose stream was closed before its last chunk."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stopped(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.aborted or request_id in self.closed_early


def frame(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\0"


def make_fake_worker(models: list[str], *, stock: bool = False) -> tuple[FastAPI, FakeWorkerState]:
    """A worker whose model says REPLY. Prompts steer it: SLOW (one token per 50 ms, forever),
    FAIL_EARLY (an error chunk first), FAIL_LATE (an error chunk after two tokens)."""
    app = FastAPI()
    state = FakeWorkerState()

    @app.post("/worker_get_status")
    async def status() -> dict[str, Any]:
        return {"model_names": models, "speed": 1, "queue_length": 0}

    @app.post("/count_token")
    async def count(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"count": count_tokens(body["prompt"]), "error_code": 0}

    @app.post("/model_details")
    async def details() -> dict[str, Any]:
        return {"context_length": CONTEXT_LENGTH}

    @app.post("/worker_abort")
    async def abort(request: Request) -> dict[str, Any]:
        body = await request.json()
        with state.lock:
            state.aborted.append(body["request_id"])
        return {"aborted": True}

    if stock:

        @app.post("/worker_get_conv_template")
        async def conv() -> dict[str, Any]:
            return {"conv": CHATML_CONV}

    else:

        @app.post("/worker_apply_chat_template")
        async def apply_chat_template(request: Request) -> JSONResponse:
            body = await request.json()
            if body["model"] not in models:
                return JSONResponse({"text": "no such model", "error_code": 40301}, status_code=404)
            prompt = "".join(f"<{m['role']}> {m['content']}\n" for m in body["messages"]) + "<assistant>"
            return JSONResponse(
                {"prompt": prompt, "prompt_tokens": count_tokens(prompt), "context_length": CONTEXT_LENGTH}
            )

    @app.post("/worker_generate_stream")
    async def generate(request: Request) -> StreamingResponse:
        raw = await request.json()
        with state.lock:
            state.params.append(raw)
        params = WorkerParams.model_validate(raw)
        return StreamingResponse(_generate(params, state), media_type="application/octet-stream")

    return app, state


async def _generate(params: WorkerParams, state: FakeWorkerState) -> AsyncIterator[bytes]:
    prompt = params.prompt
    prompt_tokens = count_tokens(prompt)
    if "HANG" in prompt:
        await asyncio.sleep(3)  # longer than the impatient gateway's worker_timeout
    if "FAIL_EARLY" in prompt:
        yield frame({"text": "the fake worker refuses", "error_code": 40302})
        return
    slow = "SLOW" in prompt
    prefix = prompt if params.echo else ""
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    text = ""
    tokens: list[str] = []
    finished = False
    try:
        for i in range(params.max_new_tokens):
            if "FAIL_LATE" in prompt and i == 2:
                yield frame({"text": "the fake worker broke", "error_code": 50001})
                finished = True
                return
            token = REPLY[i % len(REPLY)] if not slow else " tick"
            if token == "é":  # half of a two-byte character first
                yield _chunk(prefix + text + "\ufffd", prompt_tokens, i, None, params, tokens)
            text += token
            tokens.append(token)
            reason = None
            for stop in stops:
                if stop in text:
                    text, reason = text[: text.index(stop)], "stop"
                    tokens = tokens[:-1]
            if reason is None and i + 1 == params.max_new_tokens:
                reason = "length"
            if reason is None and not slow and i + 1 == len(REPLY) and not params.ignore_eos:
                reason = "stop"
            data = _chunk(prefix + text, prompt_tokens, i + 1, reason, params, tokens)
            # Split every frame in two writes so the reader has to join them.
            yield data[:7]
            await asyncio.sleep(0.05 if slow else 0)
            yield data[7:]
            if reason is not None:
                finished = True
                return
    finally:
        if not finished:
            with state.lock:
                state.closed_early.append(params.request_id or "")


def _chunk(
    text: str, prompt_tokens: int, completion_tokens: int, reason: str | None, params: WorkerParams, tokens: list[str]
) -> bytes:
    logprobs = None
    if params.logprobs is not None:
        offsets, pos = [], len(params.prompt) if params.echo else 0
        for token in tokens:
            offsets.append(pos)
            pos += len(token)
        logprobs = {
            "text_offset": offsets,
            "tokens": tokens,
            "token_logprobs": [-0.5] * len(tokens),
            "top_logprobs": [{t: -0.5, "other": -1.5} for t in tokens],
        }
    return frame(
        {
            "text": text,
            "error_code": 0,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "finish_reason": reason,
            "logprobs": logprobs,
        }
    )


# ---- the cluster -----------------------------------------------------------------------------------


@dataclass
class Cluster:
    gateway: str
    gateway_app: FastAPI
    controller: str
    controller_app: FastAPI
    worker: FakeWorkerState
    stock_worker: FakeWorkerState
    gone_worker_url: str


def _register(controller: str, worker_url: str, models: list[str]) -> None:
    response = httpx.post(
        f"{controller}/register_worker",
        json={
            "worker_name": worker_url,
            "check_heart_beat": False,
            "worker_status": {"model_names": models, "speed": 1, "queue_length": 0},
        },
    )
    response.raise_for_status()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with ExitStack() as stack:
        controller_app = create_controller_app(ControllerConfig())
        controller = stack.enter_context(serve_in_thread(controller_app))
        worker_app, worker_state = make_fake_worker([MODEL])
        worker_url = stack.enter_context(serve_in_thread(worker_app))
        stock_app, stock_state = make_fake_worker([STOCK_MODEL], stock=True)
        stock_url = stack.enter_context(serve_in_thread(stock_app))
        gone_app, _ = make_fake_worker([GONE_MODEL])
        gone_url = stack.enter_context(serve_in_thread(gone_app))
        _register(controller, worker_url, [MODEL])
        _register(controller, stock_url, [STOCK_MODEL])
        _register(controller, gone_url, [GONE_MODEL])
        # Registered, but nothing listens there.
        _register(controller, f"http://127.0.0.1:{_free_port()}", [DEAD_MODEL])
        settings = GatewaySettings(controller_address=controller, api_keys=(API_KEY, "sk-other"), worker_timeout=30)
        gateway_app = create_app(settings)
        gateway = stack.enter_context(serve_in_thread(gateway_app))
        yield Cluster(gateway, gateway_app, controller, controller_app, worker_state, stock_state, gone_url)


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key=API_KEY, max_retries=0, timeout=20)


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=cluster.gateway, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=20
    ) as http_client:
        yield http_client


FULL_REPLY = "".join(REPLY)
USER = [{"role": "user", "content": "Say hi"}]


# ---- happy paths -----------------------------------------------------------------------------------


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {MODEL, STOCK_MODEL, GONE_MODEL, DEAD_MODEL} <= ids
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "llmplatform")
    response = http.get("/v1/models/no-such-model")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert http.get("/health").status_code == 200


def test_chat_non_streamed(client: openai.OpenAI, cluster: Cluster) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == FULL_REPLY
    assert result.choices[0].finish_reason == "stop"
    prompt_tokens = count_tokens("<user> Say hi\n<assistant>")
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == len(REPLY)
    assert result.usage.total_tokens == prompt_tokens + len(REPLY)
    sent = cluster.worker.params[-1]
    assert sent["echo"] is False and sent["max_new_tokens"] == 20 and sent["prompt"] == "<user> Say hi\n<assistant>"


def test_chat_default_max_tokens_fills_context(client: openai.OpenAI, cluster: Cluster) -> None:
    client.chat.completions.create(model=MODEL, messages=USER)
    assert cluster.worker.params[-1]["max_new_tokens"] == CONTEXT_LENGTH - count_tokens("<user> Say hi\n<assistant>")


def test_chat_length_and_stop(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=2, max_tokens=30)
    assert result.choices[0].message.content == "Hello,"
    assert result.choices[0].finish_reason == "length"
    result = client.chat.completions.create(model=MODEL, messages=USER, stop=[" from"])
    assert result.choices[0].message.content == "Hello, café"
    assert result.choices[0].finish_reason == "stop"


def test_chat_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == FULL_REPLY  # the half character was held back, never sent
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_chat_stream_raw_sse(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": USER, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: ") :])
    assert "usage" not in first  # only with stream_options.include_usage
    final = json.loads(events[-2][len("data: ") :])
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "stop"


def test_chat_n3_streamed_with_usage(client: openai.OpenAI, cluster: Cluster) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, n=3, seed=11, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    usage = usage_chunks[0].usage
    prompt_tokens = count_tokens("<user> Say hi\n<assistant>")
    assert usage.prompt_tokens == prompt_tokens  # the prompt counts once, not once per choice
    assert usage.completion_tokens == 3 * len(REPLY)
    assert all(c.usage is None for c in chunks[:-1])
    by_index: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        by_index[c.choices[0].index].append(c.choices[0])
    for index, choices in by_index.items():
        assert choices[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in choices) == FULL_REPLY
        assert [ch.finish_reason for ch in choices if ch.finish_reason] == ["stop"], index
    seeds = sorted(p["seed"] for p in cluster.worker.params[-3:])
    assert seeds == [11, 12, 13]
    assert len({p["request_id"] for p in cluster.worker.params[-3:]}) == 3


def test_chat_n3_non_streamed(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, n=3, max_tokens=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello, caf" and c.finish_reason == "length" for c in result.choices)
    assert result.usage.completion_tokens == 9


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2, max_tokens=2)
    content = result.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hello", ","]
    assert content[0].logprob == -0.5 and content[0].bytes == list(b"Hello")
    assert [t.token for t in content[0].top_logprobs] == ["Hello", "other"]
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=1, stream=True
    )
    tokens = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == REPLY


def test_completions(client: openai.OpenAI, cluster: Cluster) -> None:
    result = client.completions.create(model=MODEL, prompt="Once upon")
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.choices[0].text == FULL_REPLY and result.choices[0].finish_reason == "stop"
    assert cluster.worker.params[-1]["max_new_tokens"] == 16  # OpenAI's default
    assert cluster.worker.params[-1]["echo"] is False
    assert result.usage.prompt_tokens == 2

    echoed = client.completions.create(model=MODEL, prompt="Once upon", echo=True, max_tokens=2, logprobs=1)
    assert echoed.choices[0].text == "Once uponHello,"
    assert echoed.choices[0].logprobs.tokens == ["Hello", ","]
    assert echoed.choices[0].logprobs.text_offset == [9, 14]
    sent = cluster.worker.params[-1]
    assert sent["echo"] is True and sent["logprobs"] == 1 and sent["prompt_logprobs"] == 1


def test_completions_several_prompts(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=["a b", "c d e"], n=2, max_tokens=1)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert all(c.text == "Hello" for c in result.choices)
    assert result.usage.prompt_tokens == 2 + 3
    assert result.usage.completion_tokens == 4


def test_completions_streamed(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="Once", n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(REPLY)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == FULL_REPLY
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]


def test_stock_worker_fallback(client: openai.OpenAI, cluster: Cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(model=STOCK_MODEL, messages=messages, stop="never")
    assert result.choices[0].message.content == FULL_REPLY
    sent = cluster.stock_worker.params[-1]
    assert sent["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sent["stop"] == ["never", "<|im_end|>"]
    assert sent["stop_token_ids"] == [7]
    assert sent["max_new_tokens"] == CONTEXT_LENGTH - count_tokens(sent["prompt"])


# ---- auth ------------------------------------------------------------------------------------------


def test_api_key_required(cluster: Cluster) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + API_KEY}):
        response = httpx.get(f"{cluster.gateway}/v1/models", headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    wrong = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=USER)
    other = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="sk-other", max_retries=0)
    assert other.models.list().data


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
    response = http.post("/v1/chat/completions", json=_chat_body(model=GONE_MODEL, stream=True))
    assert _assert_error(response, 503)["type"] == "service_unavailable"
    _register(cluster.controller, cluster.gone_worker_url, [GONE_MODEL])
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

    monkeypatch.setattr(cluster.gateway_app.state.worker_client, "prepare_completion", broken)
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


def _wait_for(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


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
    assert _wait_for(lambda: len(cluster.worker.params) >= before + 2)
    request_ids = [p["request_id"] for p in cluster.worker.params[before:]]
    assert len(request_ids) == 2
    # Both choices' streams end early, and the gateway also calls /worker_abort for each.
    assert _wait_for(lambda: all(cluster.worker.stopped(r) for r in request_ids)), request_ids
    assert _wait_for(lambda: all(r in cluster.worker.aborted for r in request_ids)), request_ids
    assert _wait_for(lambda: all(r in cluster.worker.closed_early for r in request_ids)), request_ids
