"""The fake worker the gateway's tests run against, and a small cluster around it.

It speaks the worker protocol (shared/PROTOCOL.md) with a scripted model, so a test can check the
gateway's own logic (routing, translation, streaming, refusals, errors, aborts) exactly; the real
worker is tested with real weights elsewhere (tests/integration/test_worker_protocol.py,
tests/badinput/test_real_model.py). What keeps it honest:

- it validates the params dict as the real worker does (`sampling_params_from`), so a value the
  gateway lets through but a worker refuses shows up as the worker's error chunk, not as a fake
  success;
- its status route answers, as the controller requires to confirm a registration;
- it records every params dict it receives, the peer port of every stream, every abort and every
  stream closed before its end, so a test can prove that a refused request never reached it or
  that a client that left was aborted.

The model says REPLY token by token (tokens are whitespace-separated words for counting: the
context is CONTEXT_LENGTH of them); "é" first arrives as half a character. Words in the prompt
steer it: SLOW (one " tick" every 50 ms until max_new_tokens), HANG (3 s of silence first, longer
than an impatient gateway's worker timeout), FAIL_EARLY (an error chunk first), FAIL_LATE (an
error chunk after two tokens). `stock=True` makes a stock FastChat worker: the conversation
template route instead of ours that applies the chat template.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.errors import ErrorCode, LLMPlatformError
from llmplatform.model_worker.requests import sampling_params_from
from llmplatform.openai_api import GatewaySettings
from llmplatform.openai_api import create_app as create_gateway_app
from llmplatform.protocol.worker import WorkerParams, error_chunk
from llmplatform.utils.server import serve_in_thread

MODEL = "fake-model"
CONTEXT_LENGTH = 64
REPLY = ["Hello", ",", " caf", "é", " from", " the", " fake", " worker", "."]
"""What the fake model says, token by token."""
FULL_REPLY = "".join(REPLY)
SLOW_TOKEN_DELAY_S = 0.05
HANG_S = 3.0

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
"""A stock worker's conversation template (FastChat's ChatML)."""


def reply(num_tokens: int) -> str:
    """The text of the first `num_tokens` tokens of REPLY (num_tokens <= len(REPLY))."""
    return "".join(REPLY[:num_tokens])


def count_tokens(text: str) -> int:
    return len(text.split())


def frame(obj: dict[str, Any]) -> bytes:
    """One chunk of a worker stream: JSON, then the NUL delimiter."""
    return json.dumps(obj).encode() + b"\0"


@dataclass
class FakeWorkerState:
    """What one fake worker has been asked; every list is guarded by `lock`."""

    params: list[dict[str, Any]] = field(default_factory=list)
    """Every params dict /worker_generate_stream received, as sent."""
    client_ports: list[int] = field(default_factory=list)
    """The peer port of each /worker_generate_stream call: one TCP connection per distinct port."""
    aborted: list[str] = field(default_factory=list)
    """request_ids from /worker_abort."""
    closed_early: list[str] = field(default_factory=list)
    """request_ids whose stream was closed before its last chunk."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> int:
        """How many generation requests reached this worker."""
        with self.lock:
            return len(self.params)

    def stopped(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.aborted or request_id in self.closed_early


def make_fake_worker(models: list[str], *, stock: bool = False) -> tuple[FastAPI, FakeWorkerState]:
    """A fake worker serving `models` (see the module docstring) and what it records."""
    app = FastAPI()
    state = FakeWorkerState()

    @app.post("/worker_get_status")  # the controller confirms a registration with it
    async def status() -> dict[str, Any]:
        return {"model_names": models, "speed": 1, "queue_length": 0}

    @app.post("/count_token")
    async def count(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"count": count_tokens(body["prompt"]), "error_code": 0}

    @app.post("/model_details")  # no "params": a stock worker's answer, none of our additions
    async def details() -> dict[str, Any]:
        return {"context_length": CONTEXT_LENGTH}

    @app.post("/worker_abort")
    async def abort(request: Request) -> dict[str, Any]:
        body = await request.json()
        with state.lock:
            state.aborted.append(body["request_id"])
        return {"aborted": True}

    @app.post("/reset_prefix_cache")
    async def reset() -> dict[str, Any]:
        return {"success": True, "model_names": models}

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
    async def generate(request: Request) -> Response:
        raw = await request.json()
        with state.lock:
            state.params.append(raw)
            state.client_ports.append(request.client.port if request.client else 0)
        try:
            params = WorkerParams.model_validate(raw)
        except ValidationError as exc:  # as the real worker answers a params dict of wrong types
            return Response(error_chunk(str(exc.errors()[0].get("msg")), ErrorCode.VALIDATION_TYPE_ERROR))
        try:
            sampling_params_from(params)  # the real worker's validation
        except LLMPlatformError as exc:
            return Response(error_chunk(exc.message, exc.error_code, exc.param))
        return StreamingResponse(_generate(params, state), media_type="application/octet-stream")

    return app, state


async def _generate(params: WorkerParams, state: FakeWorkerState) -> AsyncIterator[bytes]:
    prompt = params.prompt or ""
    prompt_tokens = count_tokens(prompt)
    if "HANG" in prompt:
        await asyncio.sleep(HANG_S)
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
            await asyncio.sleep(SLOW_TOKEN_DELAY_S if slow else 0)
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
        offsets, pos = [], len(params.prompt or "") if params.echo else 0
        for token in tokens:
            offsets.append(pos)
            pos += len(token)
        # As many alternatives as asked for (at least one): the token itself, then "other1"...
        num_top = max(params.logprobs, 1)
        logprobs = {
            "text_offset": offsets,
            "tokens": tokens,
            "token_logprobs": [-0.5] * len(tokens),
            "top_logprobs": [{t: -0.5, **{f"other{k}": -0.5 - k for k in range(1, num_top)}} for t in tokens],
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


# ---- around it ------------------------------------------------------------------------------------


def register_worker(controller: str, worker_url: str, models: list[str]) -> None:
    """Register `worker_url` with `controller` as serving `models` (no heartbeats expected)."""
    response = httpx.post(
        f"{controller}/register_worker",
        json={
            "worker_name": worker_url,
            "check_heart_beat": False,
            "worker_status": {"model_names": models, "speed": 1, "queue_length": 0},
        },
        timeout=10,
    )
    response.raise_for_status()


@dataclass
class FakeCluster:
    gateway: str
    controller: str
    worker_url: str
    worker: FakeWorkerState


@contextlib.contextmanager
def fake_cluster(**gateway_settings: Any) -> Iterator[FakeCluster]:
    """A real controller, one fake worker serving MODEL registered with it and a gateway (with
    `gateway_settings`), each a uvicorn server on 127.0.0.1."""
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(create_controller_app(ControllerConfig())))
        worker_app, worker = make_fake_worker([MODEL])
        worker_url = stack.enter_context(serve_in_thread(worker_app))
        register_worker(controller, worker_url, [MODEL])
        settings = GatewaySettings(controller_address=controller, **gateway_settings)
        gateway = stack.enter_context(serve_in_thread(create_gateway_app(settings)))
        yield FakeCluster(gateway=gateway, controller=controller, worker_url=worker_url, worker=worker)


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response is OpenAI's error envelope with `status`; returns its `error` object."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error
