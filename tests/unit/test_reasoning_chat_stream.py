"""The gateway's chat answer for a reasoning model, from scripted worker chunks: thoughts in
``reasoning_content``, the answer read for tool calls only after ``</think>`` (a call the model
thinks about is not a call), and the streamed deltas adding up to the non-streamed message
wherever the worker's text was split."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from llmplatform.openai_api.chat import ChatPrepared, _ChatStream
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.openai_api.reasoning import reasoning_mode
from llmplatform.protocol.openai import ChatCompletionRequest
from llmplatform.protocol.worker import ChunkUsage, WorkerChunk

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
THOUGHTS = ('I could write <tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call> '
            "but first, think.")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TEXT = f"{THOUGHTS}</think>\n\n{CALL}"


class _Streams:
    num_choices = 1

    def __init__(self, text: str, cuts: list[int], reason: str = "stop") -> None:
        self._text, self._cuts, self._reason = text, cuts, reason

    async def events(self):
        ends = [*self._cuts, len(self._text)]
        for i, (start, end) in enumerate(zip([0, *ends], ends)):
            final = i == len(ends) - 1
            yield 0, WorkerChunk(text=self._text[start:end], delta=True,
                                 usage=ChunkUsage(completion_tokens=i + 1),
                                 finish_reason=self._reason if final else None)

    def cancel(self) -> None:
        pass


def _stream(tools: bool = True, kwargs: dict[str, Any] | None = None) -> _ChatStream:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}],
         **({"tools": TOOLS} if tools else {}), "chat_template_kwargs": kwargs})
    reasoning = reasoning_mode("qwen3", kwargs)
    constraint = request_constraints(body).for_worker(
        "m", frozenset({"structured_output", "tools"}), "hermes", thinking=reasoning.thinking)
    prepared = ChatPrepared(3, constraint, reasoning)
    return _ChatStream(body, "chatcmpl-1", prepared=lambda: prepared)


def _streamed(stream: _ChatStream, streams: _Streams) -> tuple[str, str, list[Any], str]:
    async def collect() -> list[bytes]:
        return [event async for event in stream.events(streams)]

    reasoning, content, calls, finish = "", "", [], None
    for raw in asyncio.run(collect()):
        data = raw.decode().removeprefix("data: ").strip()
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += [c["function"] for c in delta.get("tool_calls") or []]
            finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def _whole(stream: _ChatStream, text: str, reason: str = "stop") -> dict[str, Any]:
    final = WorkerChunk(text=text, finish_reason=reason, usage=ChunkUsage(completion_tokens=9))
    return stream.response([final]).model_dump()["choices"][0]


@pytest.mark.parametrize("cut", [1, 7, 40, len(THOUGHTS) + 3, len(THOUGHTS) + 9, len(TEXT) - 5])
def test_calls_are_read_from_the_answer_only(cut: int) -> None:
    choice = _whole(_stream(), TEXT)
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == THOUGHTS
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}

    reasoning, content, calls, finish = _streamed(_stream(), _Streams(TEXT, [cut]))
    assert (reasoning, content, finish) == (THOUGHTS, "", "tool_calls")
    assert calls[0]["name"] == "get_weather"
    assert "".join(c["arguments"] for c in calls) == '{"city": "Oslo"}'


def test_no_thoughts_when_thinking_is_off() -> None:
    off = {"enable_thinking": False}
    message = _whole(_stream(tools=False, kwargs=off), "<think>x</think>y")["message"]
    assert message["content"] == "<think>x</think>y" and "reasoning_content" not in message
    assert _streamed(_stream(tools=False, kwargs=off), _Streams("a</think>b", [2]))[:2] == (
        "", "a</think>b")


@pytest.mark.parametrize("tail", ["</thi", "</think>\n<tool", "</think>ok <tool_call>\n{\"na"])
def test_a_tag_cut_by_max_tokens_is_never_content(tail: str) -> None:
    text = "thinking " + tail
    choice = _whole(_stream(), text, reason="length")
    expected_content = "ok" if "ok" in tail else None
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "thinking "
    assert (choice["message"]["content"] or None) == expected_content
    reasoning, content, calls, finish = _streamed(_stream(), _Streams(text, [len(text) - 2],
                                                                      reason="length"))
    assert (reasoning, content or None, calls, finish) == ("thinking ", expected_content, [],
                                                           "length")
