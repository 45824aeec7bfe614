"""The gateway's chat answer with tools, from scripted worker chunks: streamed ``delta.tool_calls``
accumulate (as OpenAI's SDK does) to the non-streamed reply wherever the worker's text was split,
headers come first, and finish_reason says ``tool_calls``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk

from llmplatform.openai_api.chat import _ChatStream, ChatPrepared
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.protocol.openai import ChatCompletionRequest
from llmplatform.protocol.worker import ChunkUsage, WorkerChunk

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "search")]
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
        '{"q": "caf\u00e9 \\"x\\""}}\n</tool_call>')


class _Streams:
    """The worker's delta chunks for one choice (what the main path reads), cut at the given
    positions."""

    num_choices = 1

    def __init__(self, cuts: list[int], reason: str = "stop") -> None:
        self._cuts = cuts
        self._reason = reason

    async def events(self):
        ends = [*self._cuts, len(TEXT)]
        for i, (start, end) in enumerate(zip([0, *ends], ends)):
            final = i == len(ends) - 1
            yield 0, WorkerChunk(text=TEXT[start:end], usage=ChunkUsage(completion_tokens=i + 1),
                                 finish_reason=self._reason if final else None, delta=True)

    def cancel(self) -> None:
        pass


def _stream(tool_choice: Any = "auto") -> _ChatStream:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
         "tool_choice": tool_choice})
    constraint = request_constraints(body).for_worker(
        "m", frozenset({"structured_output", "tools"}), "hermes")
    prepared = ChatPrepared(3, constraint)
    return _ChatStream(body, "chatcmpl-1", prepared=lambda: prepared)


def _events(stream: _ChatStream, streams: _Streams) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        return [event async for event in stream.events(streams)]

    events = []
    for raw in asyncio.run(collect()):
        data = raw.decode().removeprefix("data: ").strip()
        if data != "[DONE]":
            events.append(json.loads(data))
    return events


def _accumulate(events: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str, str]], str]:
    content, calls, finish = "", {}, None
    for event in events:
        chunk = ChatCompletionChunk.model_validate(event)  # OpenAI's own chunk type parses it
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for fragment in choice.delta.tool_calls or []:
                if fragment.index not in calls:
                    assert fragment.id and fragment.function.name  # the header comes first
                    calls[fragment.index] = [fragment.id, fragment.function.name, ""]
                else:
                    assert fragment.id is None and fragment.function.name is None
                calls[fragment.index][2] += fragment.function.arguments or ""
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("step", [1, 3, 7, 40])
def test_streamed_calls_accumulate_to_the_reply_wherever_the_text_is_cut(step: int) -> None:
    stream = _stream()
    reply = stream.response([WorkerChunk(text=TEXT, usage=ChunkUsage(completion_tokens=5),
                                         finish_reason="stop")]).model_dump()
    message = reply["choices"][0]["message"]
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check."
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert expected == [("get_weather", '{"city": "Paris", "days": [1, 2]}'),
                        ("search", '{"q": "caf\u00e9 \\"x\\""}')]
    assert all(c["id"].startswith("call_") and c["type"] == "function"
               for c in message["tool_calls"])

    content, calls, finish = _accumulate(_events(_stream(), _Streams(list(range(step, len(TEXT), step)))))
    assert content == "Let me check."
    assert [(name, arguments) for _, name, arguments in calls] == expected
    assert finish == "tool_calls"


def test_plain_text_with_tools_is_content_and_a_cut_call_finishes_with_length() -> None:
    stream = _stream()
    reply = stream.response([WorkerChunk(text="No tools needed.", finish_reason="stop")])
    assert reply.choices[0].message.content == "No tools needed."
    assert reply.choices[0].message.tool_calls is None
    assert "tool_calls" not in reply.model_dump()["choices"][0]["message"]
    assert reply.choices[0].finish_reason == "stop"
    _, calls, finish = _accumulate(_events(_stream("required"), _Streams([5, 60], reason="length")))
    assert finish == "length" and calls[0][1] == "get_weather"
