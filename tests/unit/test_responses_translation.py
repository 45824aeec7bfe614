"""A Responses request as the chat request that serves it, and a chat stream as its events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from llmplatform.errors import InvalidRequestError, WorkerTimeoutError
from llmplatform.openai_api.responses import finished, output_items
from llmplatform.openai_api.responses_input import (
    chat_request,
    check_refused,
    normalise_items,
    renamed,
)
from llmplatform.openai_api.responses_stream import response_events
from llmplatform.openai_api.sse import sse_event
from llmplatform.protocol.openai import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    ChatDelta,
    ChatResponseMessage,
    Usage,
)
from llmplatform.protocol.responses import ResponseObject, ResponsesRequest


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **fields})


def test_items_become_chat_messages() -> None:
    items = normalise_items([
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ])
    assert all(item.get("id") for item in items)
    body = request(instructions="Be brief.", tools=[{"type": "function", "name": "get_weather",
                                                     "parameters": {"type": "object"}}],
                   tool_choice={"type": "function", "name": "get_weather"},
                   text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
                   max_output_tokens=7, stream=True)
    chat = chat_request(body, "m", items)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "developer", "content": "a\nb"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather",
                                                            "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    assert chat.max_completion_tokens == 7 and chat.stream_options.include_usage


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
])
def test_refused_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_refused(request(**fields))
    assert caught.value.param == param
    check_refused(request(reasoning={"effort": None}, background=False, include=[], truncation="disabled"))


def test_chat_errors_use_the_responses_names() -> None:
    assert renamed(InvalidRequestError("x", param="response_format.json_schema")).param == "text.format.json_schema"
    assert renamed(InvalidRequestError("x", param="messages[3].content")).param == "input"
    assert renamed(InvalidRequestError("x", param="tools")).param == "tools"


def test_a_cut_reply_is_incomplete() -> None:
    shell = ResponseObject(id="resp_1", created_at=0, status="in_progress", model="m")
    message = ChatResponseMessage(content="Once upon")
    done = finished(shell, output_items(message, "incomplete"), Usage(prompt_tokens=3, completion_tokens=2,
                                                                        total_tokens=5), "length")
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output[0].status == "incomplete" and done.usage.total_tokens == 5


def chunk(content: str | None = None, calls: list[dict[str, Any]] | None = None,
          reason: str | None = None, usage: Usage | None = None) -> bytes:
    choices = [] if usage else [ChatCompletionStreamChoice(
        index=0, delta=ChatDelta(content=content, tool_calls=calls), finish_reason=reason)]
    return sse_event(ChatCompletionChunk(id="c", created=0, model="m", choices=choices, usage=usage))


def events_of(frames: list[bytes | Exception]) -> list[dict[str, Any]]:
    shell = ResponseObject(id="resp_1", created_at=0, status="in_progress", model="m")
    stored: list[ResponseObject] = []

    async def chat() -> AsyncGenerator[bytes, None]:
        for frame in frames:
            if isinstance(frame, Exception):
                raise frame
            yield frame

    async def finish(output: Any, usage: Any, reason: Any) -> ResponseObject:
        stored.append(finished(shell, output, usage, reason))
        return stored[-1]

    async def collect() -> list[bytes]:
        return [e async for e in response_events(chat(), shell, finish)]

    out = []
    for raw in asyncio.run(collect()):
        head, data = raw.decode().rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_text_then_a_call_stream_as_two_items() -> None:
    usage = Usage(prompt_tokens=5, completion_tokens=4, total_tokens=9)
    events = events_of([chunk(""), chunk("Hi"), chunk(" there"),
                        chunk(calls=[{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]),
                        chunk(calls=[{"index": 0, "function": {"arguments": "{\"a\""}}]),
                        chunk(calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
                        chunk(reason="tool_calls"), chunk(usage=usage)])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hi there"
    assert final["output"][1]["arguments"] == '{"a": 1}' and final["output"][1]["call_id"] == "call_1"
    assert final["usage"]["input_tokens"] == 5 and final["status"] == "completed"
    assert events[9]["output_index"] == 1


def test_a_failure_mid_stream_is_response_failed() -> None:
    events = events_of([chunk("Hi"), WorkerTimeoutError("the worker went silent")])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the worker went silent"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "the worker went silent"


def test_fields_the_responses_api_does_not_define_are_refused_by_name() -> None:
    from llmplatform.utils.json_body import parse_json_body

    for extra in ("seed", "logit_bias", "max_tokens", "n"):
        with pytest.raises(InvalidRequestError) as caught:
            parse_json_body(ResponsesRequest, json.dumps({"model": "m", "input": "x", extra: 1}).encode())
        assert caught.value.param == extra and extra in caught.value.message
    informational = {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u",
                     "stream_options": {"include_obfuscation": False}}
    parse_json_body(ResponsesRequest, json.dumps({"model": "m", "input": "x", **informational}).encode())
