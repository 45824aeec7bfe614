"""A small fake worker and a gateway in front of it, for tests of the gateway's own checks.

The worker speaks the worker protocol and validates the params dict exactly as the real worker
does (`sampling_params_from`), so a value the gateway lets through but a worker refuses still
shows up as the worker's error, not as a fake success. Tokens are whitespace-separated words;
the context is CONTEXT_LENGTH of them. Every params dict it receives is recorded, so a test can
prove that a refused request never reached a worker.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.errors import LLMPlatformError
from llmplatform.model_worker.requests import sampling_params_from
from llmplatform.openai_api import GatewaySettings
from llmplatform.openai_api import create_app as create_gateway_app
from llmplatform.protocol.worker import WorkerParams, error_chunk
from llmplatform.utils.server import serve_in_thread

MODEL = "fake-model"
CONTEXT_LENGTH = 64
WORDS = ["alpha", "beta", "gamma", "delta"]


def count_tokens(text: str) -> int:
    return len(text.split())


@dataclass
class FakeWorker:
    url: str = ""
    params: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> int:
        with self.lock:
            return len(self.params)


def _frame(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\0"


def make_fake_worker_app(state: FakeWorker) -> FastAPI:
    app = FastAPI()

    @app.post("/worker_get_status")
    async def status() -> dict[str, Any]:
        return {"model_names": [MODEL], "speed": 1, "queue_length": 0}

    @app.post("/count_token")
    async def count(request: Request) -> dict[str, Any]:
        return {"count": count_tokens((await request.json())["prompt"]), "error_code": 0}

    @app.post("/model_details")
    async def details() -> dict[str, Any]:
        return {"context_length": CONTEXT_LENGTH}

    @app.post("/worker_apply_chat_template")
    async def apply_chat_template(request: Request) -> JSONResponse:
        body = await request.json()
        prompt = "".join(f"<{m['role']}> {m['content']}\n" for m in body["messages"]) + "<assistant>"
        return JSONResponse({"prompt": prompt, "prompt_tokens": count_tokens(prompt), "context_length": CONTEXT_LENGTH})

    @app.post("/worker_abort")
    async def abort() -> dict[str, Any]:
        return {"aborted": True}

    @app.post("/reset_prefix_cache")
    async def reset() -> dict[str, Any]:
        return {"success": True, "model_names": [MODEL]}

    @app.post("/worker_generate_stream")
    async def generate(request: Request) -> Response:
        raw = await request.json()
        with state.lock:
            state.params.append(raw)
        params = WorkerParams.model_validate(raw)
        try:
            sampling_params_from(params)  # the real worker's validation
        except LLMPlatformError as exc:
            return Response(error_chunk(exc.message, exc.error_code))
        return StreamingResponse(_generate(params), media_type="application/octet-stream")

    return app


async def _generate(params: WorkerParams) -> AsyncIterator[bytes]:
    prompt_tokens = count_tokens(params.prompt)
    text = params.prompt if params.echo else ""
    tokens: list[str] = []
    steps = min(params.max_new_tokens, len(WORDS))
    for i in range(steps):
        token = (" " if text else "") + WORDS[i]
        text += token
        tokens.append(token)
        reason = None if i + 1 < steps else ("length" if steps == params.max_new_tokens else "stop")
        logprobs = None
        if params.logprobs is not None:
            top = max(params.logprobs, 1)
            logprobs = {
                "text_offset": list(range(len(tokens))),
                "tokens": tokens,
                "token_logprobs": [-0.5] * len(tokens),
                "top_logprobs": [{f"{t}{k}": -0.5 - k for k in range(top)} for t in tokens],
            }
        yield _frame({
            "text": text,
            "error_code": 0,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                      "total_tokens": prompt_tokens + i + 1},
            "finish_reason": reason,
            "logprobs": logprobs,
        })


@dataclass
class FakeCluster:
    gateway: str
    controller: str
    worker: FakeWorker


@contextlib.contextmanager
def fake_cluster(**gateway_settings: Any) -> Iterator[FakeCluster]:
    """A real controller, the fake worker registered with it and a gateway (with
    `gateway_settings`), each a uvicorn server on 127.0.0.1."""
    worker = FakeWorker()
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(create_controller_app(ControllerConfig())))
        worker.url = stack.enter_context(serve_in_thread(make_fake_worker_app(worker)))
        httpx.post(f"{controller}/register_worker", json={
            "worker_name": worker.url, "check_heart_beat": False,
            "worker_status": {"model_names": [MODEL], "speed": 1, "queue_length": 0},
        }, timeout=10).raise_for_status()
        settings = GatewaySettings(controller_address=controller, **gateway_settings)
        gateway = stack.enter_context(serve_in_thread(create_gateway_app(settings)))
        yield FakeCluster(gateway=gateway, controller=controller, worker=worker)


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response is OpenAI's error envelope with `status`; returns its `error` object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error
