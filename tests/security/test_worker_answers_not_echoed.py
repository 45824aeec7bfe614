"""What a failing or hostile worker answers never reaches API clients beyond a short, safe message.

A rogue worker (a real uvicorn server on 127.0.0.1) registers with a real controller and is
reached through a real gateway with the official `openai` client. Each of its models fails in
one way, every failure carrying MARKER: a 500 with a long HTML body, a 400 in FastAPI's
`{"detail"}` shape, a stream frame that is not JSON, an error object with an unknown code, a
known FastChat error with a very long text. The client's error never contains MARKER (a known
error's text is passed on, cut short before it). The controller's own stream proxy and its
registration errors are held to the same rule.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.openai_api import GatewaySettings
from llmplatform.openai_api import create_app as create_gateway_app
from llmplatform.utils.peer_text import MAX_PEER_TEXT_CHARS
from llmplatform.utils.server import serve_in_thread

MARKER = "SECRET-WORKER-BODY-7f3a"
LONG = "x" * 5000

HTTP_500 = "http-500"
DETAIL_400 = "detail-400"
MALFORMED_FRAME = "malformed-frame"
UNKNOWN_CODE = "unknown-code"
LONG_KNOWN_ERROR = "long-known-error"
SHORT_KNOWN_ERROR = "short-known-error"
DETAILS_500 = "details-500"
MODELS = [HTTP_500, DETAIL_400, MALFORMED_FRAME, UNKNOWN_CODE, LONG_KNOWN_ERROR, SHORT_KNOWN_ERROR, DETAILS_500]


def frame(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\0"


def rogue_worker() -> FastAPI:
    app = FastAPI()

    @app.post("/worker_get_status")
    async def status() -> dict[str, Any]:
        return {"model_names": MODELS, "speed": 1, "queue_length": 0}

    @app.post("/model_details")
    async def details(request: Request) -> Response:
        model = (await request.json())["model"]
        if model == DETAILS_500:
            return Response(f"<html>{LONG}{MARKER}</html>", status_code=500, media_type="text/html")
        # Our protocol's single-call additions: the gateway sends messages straight to generate.
        return JSONResponse({"context_length": 4096, "params": ["messages", "openai_max_tokens"]})

    @app.post("/worker_generate_stream")
    async def generate(request: Request) -> Response:
        model = (await request.json())["model"]
        if model == HTTP_500:
            return Response(f"<html><pre>Traceback ... {MARKER} {LONG}</pre></html>", status_code=500,
                            media_type="text/html")
        if model == DETAIL_400:
            return JSONResponse({"detail": f"{MARKER} internal path /srv/secret"}, status_code=400)

        async def chunks() -> AsyncIterator[bytes]:
            if model == MALFORMED_FRAME:
                yield frame({"text": "Hel", "error_code": 0})
                yield f"<html>{MARKER}</html>".encode() + b"\0"
            elif model == UNKNOWN_CODE:
                yield frame({"text": MARKER, "error_code": 12345})
            elif model == LONG_KNOWN_ERROR:
                yield frame({"text": f"Invalid parameter: {LONG} {MARKER}", "error_code": 40302})
            elif model == SHORT_KNOWN_ERROR:
                yield frame({"text": "temperature is out of range", "error_code": 40302})

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    return app


@dataclass
class Cluster:
    controller: str
    gateway: str
    worker: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(create_controller_app(ControllerConfig())))
        worker = stack.enter_context(serve_in_thread(rogue_worker()))
        response = httpx.post(f"{controller}/register_worker", timeout=10, json={
            "worker_name": worker, "check_heart_beat": False,
            "worker_status": {"model_names": MODELS, "speed": 1, "queue_length": 0}})
        assert response.status_code == 200 and response.json() is None, response.text
        settings = GatewaySettings(controller_address=controller, max_worker_attempts=1)
        gateway = stack.enter_context(serve_in_thread(create_gateway_app(settings)))
        yield Cluster(controller, gateway, worker)


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="unused", max_retries=0, timeout=30)


def chat_error(client: openai.OpenAI, model: str, *, stream: bool) -> openai.APIError:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.APIError) as caught:
        if stream:
            for _ in client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=True):
                pass
        else:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    return caught.value


def message_of(error: openai.APIError) -> str:
    """The envelope's `message` (the client prefixes its own `Error code: ...` to `.message`)."""
    body = error.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return error.message


def everything_the_client_saw(error: openai.APIError) -> str:
    parts = [str(error), error.message, json.dumps(error.body)]
    response = getattr(error, "response", None)
    if response is not None:
        with contextlib.suppress(Exception):
            parts.append(response.text)
    return " ".join(parts)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("model", [HTTP_500, DETAIL_400, MALFORMED_FRAME, UNKNOWN_CODE, DETAILS_500])
def test_an_invalid_worker_answer_is_described_never_quoted(client: openai.OpenAI, model: str, stream: bool) -> None:
    error = chat_error(client, model, stream=stream)
    seen = everything_the_client_saw(error)
    assert MARKER not in seen and "<html>" not in seen and "/srv/secret" not in seen
    assert "invalid response" in message_of(error), message_of(error)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_known_worker_error_keeps_its_text_cut_short(client: openai.OpenAI, stream: bool) -> None:
    error = chat_error(client, LONG_KNOWN_ERROR, stream=stream)
    assert message_of(error).startswith("Invalid parameter: xxx")
    assert len(message_of(error)) <= MAX_PEER_TEXT_CHARS and MARKER not in everything_the_client_saw(error)
    short = chat_error(client, SHORT_KNOWN_ERROR, stream=stream)
    assert message_of(short) == "temperature is out of range"
    if not stream:
        assert isinstance(short, openai.BadRequestError)


# ---- the controller's own stream proxy, and its registration errors ---------------------------------


@pytest.mark.parametrize("model", [HTTP_500, DETAIL_400, MALFORMED_FRAME, UNKNOWN_CODE, LONG_KNOWN_ERROR])
def test_the_controllers_proxy_does_not_relay_a_workers_invalid_answer(cluster: Cluster, model: str) -> None:
    response = httpx.post(f"{cluster.controller}/worker_generate_stream",
                          json={"model": model, "prompt": "hi"}, timeout=30)
    assert response.status_code == 200
    frames = [json.loads(part) for part in response.content.split(b"\0") if part.strip()]
    assert MARKER not in response.text and "<html>" not in response.text
    last = frames[-1]
    assert last["error_code"] != 0 and len(last["text"]) <= MAX_PEER_TEXT_CHARS
    if model == MALFORMED_FRAME:  # the good frame before the bad one still arrives
        assert frames[0] == {"text": "Hel", "error_code": 0}


def status_route_app(answer: Response) -> FastAPI:
    app = FastAPI()

    @app.post("/worker_get_status")
    async def status() -> Response:
        return answer

    return app


@pytest.mark.parametrize("answer", [
    Response(f"<html>{MARKER}</html>", status_code=500, media_type="text/html"),
    Response(f"{{not json {MARKER}", status_code=200, media_type="application/json"),
    JSONResponse({"model_names": MARKER, "speed": "fast"}),
    Response(MARKER * 10000, status_code=200, media_type="application/json"),
], ids=["http-500", "not-json", "not-a-status", "huge"])
def test_a_registration_error_never_quotes_the_workers_answer(cluster: Cluster, answer: Response) -> None:
    with serve_in_thread(status_route_app(answer)) as worker:
        for status in (None, {"model_names": ["m"], "speed": 1, "queue_length": 0}):
            response = httpx.post(f"{cluster.controller}/register_worker", timeout=10,
                                  json={"worker_name": worker, "worker_status": status})
            assert response.status_code == 400
            error = response.json()["error"]
            assert "cannot get status" in error and MARKER not in error and len(error) < 300
    assert httpx.post(f"{cluster.controller}/list_models").json()["models"] == sorted(MODELS)
