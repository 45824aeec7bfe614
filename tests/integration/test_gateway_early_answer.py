"""A streamed answer begins when the worker has accepted the request, not at its first token.

Fake workers that speak our addition (``ACCEPTED_HEADER`` on their stream's answer: they checked
the request) behind a real controller and gateway, each a uvicorn server on 127.0.0.1. The
gateway sends its client the answer's status and headers as soon as the worker accepts (the
client reads them during the prefill); a worker lost after accepting but before its first chunk
is still replaced by another, since the client has had nothing but headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.openai_api import GatewaySettings, create_app
from llmplatform.protocol.worker import ACCEPTED_HEADER
from llmplatform.utils.server import serve_in_thread
from tests.integration.fake_worker import frame, register_worker

MODEL = "early-model"
LOST_MODEL = "lost-model"
WORDS = ["Early", " bird", "."]


@dataclass
class AcceptingWorker:
    """Accepts every request at once (the header), then: "HOLD" waits for `release` before its
    first chunk; "LOSE" drops the connection before any chunk if `lose` is still set (the
    first worker to get such a request loses it, when `lose` is shared)."""

    release: threading.Event = field(default_factory=threading.Event)
    lose: threading.Event | None = None
    released_in_time: list[bool] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def app(self, models: list[str]) -> FastAPI:
        app = FastAPI()

        @app.post("/worker_get_status")  # the controller confirms a registration with it
        async def status() -> JSONResponse:
            return JSONResponse({"model_names": models, "speed": 1, "queue_length": 0})

        @app.post("/model_details")
        async def details() -> JSONResponse:
            return JSONResponse({"context_length": 64, "params": ["messages", "openai_max_tokens"]})

        @app.post("/worker_abort")
        async def abort() -> JSONResponse:
            return JSONResponse({"aborted": False})

        @app.post("/worker_generate_stream")
        async def generate(request: Request) -> StreamingResponse:
            params = await request.json()
            self.calls.append(params["prompt"])
            return StreamingResponse(self._chunks(params), headers={ACCEPTED_HEADER: "1"},
                                     media_type="application/octet-stream")

        return app

    async def _chunks(self, params: dict) -> AsyncIterator[bytes]:
        prompt = params["prompt"]
        if "HOLD" in prompt:
            released = await asyncio.to_thread(self.release.wait, 10)
            self.released_in_time.append(released)
        if "LOSE" in prompt and self.lose is not None and self.lose.is_set():
            self.lose.clear()
            raise ConnectionAbortedError("the fake worker dies before its first chunk")
        text = ""
        for i, word in enumerate(WORDS):
            text += word
            done = i + 1 == len(WORDS)
            yield frame({"text": text, "error_code": 0, "finish_reason": "stop" if done else None,
                         "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i}})


@dataclass
class Cluster:
    gateway: str
    holder: AcceptingWorker
    pair: list[AcceptingWorker]
    lost: AcceptingWorker


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(create_controller_app(ControllerConfig())))
        lose_once = threading.Event()
        pair = [AcceptingWorker(lose=lose_once), AcceptingWorker(lose=lose_once)]
        for worker in pair:
            register_worker(controller, stack.enter_context(serve_in_thread(worker.app([MODEL]))), [MODEL])
        lost = AcceptingWorker(lose=threading.Event())
        register_worker(controller, stack.enter_context(serve_in_thread(lost.app([LOST_MODEL]))), [LOST_MODEL])
        gateway = stack.enter_context(serve_in_thread(create_app(GatewaySettings(controller_address=controller))))
        yield Cluster(gateway, pair[0], pair, lost)


def events(lines: Iterator[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def completion(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}


def test_the_answer_begins_before_the_first_token(cluster):
    """Both workers hold their first chunk until the client has the answer's headers."""
    for worker in cluster.pair:
        worker.release.clear()
    with httpx.stream("POST", f"{cluster.gateway}/v1/completions", json=completion(MODEL, "HOLD"),
                      timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for worker in cluster.pair:
            worker.release.set()  # only now can the worker's first chunk come
        got = events(response.iter_lines())
    assert [w for worker in cluster.pair for w in worker.released_in_time] == [True]
    assert "".join(e["choices"][0]["text"] for e in got if isinstance(e, dict)) == "".join(WORDS)
    assert got[-1] == "[DONE]"


def test_a_worker_lost_after_accepting_is_replaced(cluster):
    before = [len(w.calls) for w in cluster.pair]
    for worker in cluster.pair:
        worker.lose.set()
    response = httpx.post(f"{cluster.gateway}/v1/completions", json=completion(MODEL, "LOSE"), timeout=30)
    assert response.status_code == 200
    got = events(response.text.splitlines())
    assert not any(isinstance(e, dict) and "error" in e for e in got), got
    assert "".join(e["choices"][0]["text"] for e in got if isinstance(e, dict)) == "".join(WORDS)
    # One worker lost it, the other one served it.
    assert [len(w.calls) - b for w, b in zip(cluster.pair, before)] == [1, 1]
    assert not cluster.pair[0].lose.is_set()


def test_with_no_worker_left_the_stream_ends_with_an_error_event(cluster):
    """The status (200) went out with the acceptance: the failure is an event, then [DONE]."""
    cluster.lost.lose.set()
    response = httpx.post(f"{cluster.gateway}/v1/completions", json=completion(LOST_MODEL, "LOSE"), timeout=30)
    assert response.status_code == 200
    got = events(response.text.splitlines())
    assert got[-1] == "[DONE]"
    errors = [e["error"] for e in got if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["type"] == "service_unavailable", errors
    assert "unreachable" in errors[0]["message"]
    assert not any(isinstance(e, dict) and e.get("choices") for e in got)
    # The gateway still serves.
    ok = httpx.post(f"{cluster.gateway}/v1/completions", json={**completion(MODEL, "hi"), "stream": False}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "".join(WORDS)
