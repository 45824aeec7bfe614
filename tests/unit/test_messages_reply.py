"""Worker chunks -> an Anthropic message and its stream (messages_stream), with the chat path's
streams replaced by a fake that yields given chunks; and Anthropic's error envelope
(messages_errors) on every refusal of the Messages routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from llmplatform.errors import InvalidRequestError, ModelNotFoundError, NoWorkerError
from llmplatform.openai_api.chat import ChatPrepared
from llmplatform.openai_api.constraints import WorkerConstraint
from llmplatform.openai_api.errors import EnvelopeRoute, install_exception_handlers
from llmplatform.openai_api.messages_errors import ANTHROPIC_FRAMING, AnthropicErrorMiddleware
from llmplatform.openai_api.messages_stream import MessagesReply, tool_input
from llmplatform.openai_api.tools.calls import TOOL_CALL_FORMATS
from llmplatform.protocol.anthropic import MessagesRequest
from llmplatform.protocol.worker import ChunkUsage, WorkerChunk

PROMPT_TOKENS = 11
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def body(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 50,
                                           "messages": [{"role": "user", "content": "Hi"}], **fields})


def chunks(pieces: list[str], reason: str = "stop", stop_str: str | None = None) -> list[WorkerChunk]:
    """Delta frames, one per piece, the last finishing with `reason`."""
    return [WorkerChunk(text=piece, delta=True,
                        usage=ChunkUsage(prompt_tokens=PROMPT_TOKENS, completion_tokens=i + 1),
                        finish_reason=reason if i == len(pieces) - 1 else None,
                        stop_str=stop_str if i == len(pieces) - 1 else None)
            for i, piece in enumerate(pieces)]


def reply(request: MessagesRequest, *, tools: bool = False) -> MessagesReply:
    constraint = (WorkerConstraint(None, [], TOOL_CALL_FORMATS["hermes"], ("get_weather",)) if tools
                  else WorkerConstraint(None, None, None))
    return MessagesReply(request, "msg_1", prepared=lambda: ChatPrepared(0, constraint))


class FakeStreams:
    def __init__(self, frames: list[WorkerChunk]) -> None:
        self.frames = frames

    async def events(self) -> AsyncIterator[tuple[int, WorkerChunk]]:
        for frame in self.frames:
            yield 0, frame


async def stream(request: MessagesRequest, frames: list[WorkerChunk], **kwargs: Any) -> list[dict[str, Any]]:
    events = []
    async for raw in reply(request, **kwargs).events(FakeStreams(frames)):  # type: ignore[arg-type]
        name, data = raw.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def whole(frames: list[WorkerChunk]) -> WorkerChunk:
    return frames[-1].model_copy(update={"text": "".join(f.text for f in frames), "delta": False})


async def test_text_whole_and_streamed() -> None:
    frames = chunks(["Hello", " there"])
    message = reply(body()).response([whole(frames)]).model_dump()
    assert message == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                       "content": [{"type": "text", "text": "Hello there"}], "stop_reason": "end_turn",
                       "stop_sequence": None, "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": 2}}
    events = await stream(body(), frames)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[0]["message"]["usage"]["input_tokens"] == PROMPT_TOKENS
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    assert [e["delta"] for e in events[3:5]] == [{"type": "text_delta", "text": "Hello"},
                                                 {"type": "text_delta", "text": " there"}]
    assert events[6]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[6]["usage"] == {"output_tokens": 2}


async def test_stop_reasons() -> None:
    request = body(stop_sequences=["END"])
    by_stop = chunks(["Hi"], stop_str="END")
    assert (reply(request).response([whole(by_stop)]).stop_reason,
            reply(request).response([whole(by_stop)]).stop_sequence) == ("stop_sequence", "END")
    assert (await stream(request, by_stop))[-2]["delta"] == {"stop_reason": "stop_sequence",
                                                            "stop_sequence": "END"}
    assert reply(request).response([whole(chunks(["Hi"], reason="length"))]).stop_reason == "max_tokens"
    # A stop string the request did not ask for (none of ours) is no stop_sequence.
    assert reply(body()).response([whole(chunks(["Hi"], stop_str="END"))]).stop_reason == "end_turn"


async def test_tool_calls_become_tool_use_blocks() -> None:
    frames = chunks(["Let me check.\n", CALL[:20], CALL[20:45], CALL[45:]])
    message = reply(body(), tools=True).response([whole(frames)])
    assert message.stop_reason == "tool_use"
    text, call = message.content
    assert text.text == "Let me check." and call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert call.id.startswith("toolu_")
    events = await stream(body(), frames, tools=True)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["text", "tool_use"]
    assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
              and e["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    # Cut by max_tokens inside the arguments: the call keeps what was written, reported as cut.
    cut = reply(body(), tools=True).response([whole(chunks([CALL[:CALL.index("slo")]], reason="length"))])
    assert cut.stop_reason == "max_tokens" and cut.content[0].input == {"city": "O"}


def test_tool_input_of_arguments() -> None:
    assert tool_input('{"a": [1, 2]}') == {"a": [1, 2]}
    assert tool_input('{"a": "b') == {"a": "b"}
    assert tool_input("[1]") == {} and tool_input("{'a': 1}") == {}


def test_a_failed_stream_is_an_error_event() -> None:
    name, data = ANTHROPIC_FRAMING.error_event(NoWorkerError("no worker")).decode().strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "no worker"}}
    assert ANTHROPIC_FRAMING.end == b""


async def test_every_refusal_on_the_messages_routes_is_anthropics() -> None:
    app = FastAPI()
    app.router.route_class = EnvelopeRoute  # as the gateway's routes: a bug is a JSON 500 too
    install_exception_handlers(app)
    app.add_middleware(AnthropicErrorMiddleware)

    @app.post("/v1/messages")
    async def messages(kind: str) -> dict[str, str]:
        raise {"bad": InvalidRequestError("no", param="max_tokens"), "missing": ModelNotFoundError("gone"),
               "busy": NoWorkerError("busy"), "bug": RuntimeError("boom")}[kind]

    @app.post("/v1/chat/completions")
    async def chat() -> None:
        raise InvalidRequestError("no")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        expected = {"bad": (400, "invalid_request_error", "max_tokens: no"), "missing": (404, "not_found_error", "gone"),
                    "busy": (529, "overloaded_error", "busy"), "bug": (500, "api_error", None)}
        for kind, (status, error_type, message) in expected.items():
            response = await client.post("/v1/messages", params={"kind": kind})
            assert response.status_code == status
            assert response.json()["type"] == "error" and response.json()["error"]["type"] == error_type
            assert message is None or response.json()["error"]["message"] == message
            assert int(response.headers["content-length"]) == len(response.content)
        unknown = await client.post("/v1/messages/batches")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        assert "error" in (await client.post("/v1/chat/completions")).json()  # OpenAI's, untouched
        assert "type" not in (await client.post("/v1/chat/completions")).json()
