"""A fake worker and a cluster around it for the gateway's end-to-end tests: a real controller,
fake workers and the gateway on real uvicorn servers (test_gateway_fake_worker*.py).

The fake worker speaks the worker protocol with deterministic output, so those tests check the
gateway's logic (routing, translation, streaming, errors, aborts); the real worker has its own
tests with real weights.
"""

from __future__ import annotations

import asyncio
import json
import threading
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
    client_ports: list[int] = field(default_factory=list)
    """The peer port of each /worker_generate_stream call: one TCP connection per distinct port."""
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
            state.client_ports.append(request.client.port if request.client else 0)
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


def register_worker(controller: str, worker_url: str, models: list[str]) -> None:
    response = httpx.post(
        f"{controller}/register_worker",
        json={
            "worker_name": worker_url,
            "check_heart_beat": False,
            "worker_status": {"model_names": models, "speed": 1, "queue_length": 0},
        },
    )
    response.raise_for_status()


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
        register_worker(controller, worker_url, [MODEL])
        register_worker(controller, stock_url, [STOCK_MODEL])
        register_worker(controller, gone_url, [GONE_MODEL])
        # Registered (the controller confirms a worker that answers), then gone: nothing listens
        # there any more.
        dead_app, _ = make_fake_worker([DEAD_MODEL])
        with serve_in_thread(dead_app) as dead_url:
            register_worker(controller, dead_url, [DEAD_MODEL])
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
