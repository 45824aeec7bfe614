"""A reasoning model's thoughts on /v1/messages: the request's ``thinking`` (messages_translate:
what it asks, and the chat request each worker is to serve), and the thinking block ahead of the
answer, whole and streamed (messages_stream), from scripted worker chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.chat import ChatPrepared
from llmplatform.openai_api.constraints import WorkerConstraint
from llmplatform.openai_api.messages_stream import MessagesReply
from llmplatform.openai_api.messages_translate import (
    THINKING_OFF, Thinking, chat_for_worker, chat_request, thinking_of,
)
from llmplatform.openai_api.reasoning import reasoning_mode
from llmplatform.openai_api.tools.calls import TOOL_CALL_FORMATS
from llmplatform.openai_api.worker_details import ModelDetails
from llmplatform.protocol.anthropic import CountTokensRequest
from tests.unit.test_messages_reply import CALL, FakeStreams, body, chunks, whole

OURS = frozenset({"messages", "chat_template_kwargs"})


def details(parser: str | None, extensions: frozenset[str] = OURS) -> ModelDetails:
    return ModelDetails(context_length=512, extensions=extensions, tool_call_parser="hermes",
                        reasoning_parser=parser, raw={})


# ---- the request's thinking ----------------------------------------------------------------------


def test_what_thinking_asks() -> None:
    assert thinking_of(body()) == Thinking("default")
    assert thinking_of(body(thinking={"type": "adaptive"})) == Thinking("default")
    assert thinking_of(body(thinking={"type": "disabled"})) == Thinking("off")
    # A budget no smaller than max_tokens (50) constrains nothing: honoured as the default.
    assert thinking_of(body(thinking={"type": "enabled", "budget_tokens": 50})) == Thinking("on")
    assert thinking_of(body(thinking={"type": "enabled", "budget_tokens": 4096,
                                      "display": "omitted"})) == Thinking("on", omit=True)
    assert thinking_of(body(thinking={"type": "adaptive", "display": "summarized"})) == Thinking("default")


def test_a_budget_that_would_constrain_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        thinking_of(body(thinking={"type": "enabled", "budget_tokens": 49}))
    assert caught.value.param == "thinking.budget_tokens"
    assert "at least max_tokens (50)" in caught.value.message
    # count_tokens has no max_tokens: the budget changes no prompt.
    count = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                               "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert thinking_of(count) == Thinking("on")


def test_each_worker_is_told_what_it_can_be_told() -> None:
    chat = chat_request(body(thinking={"type": "disabled"}))
    assert chat.chat_template_kwargs is None
    off = Thinking("off")
    # qwen3 (and a model served without a reasoning parser): the template is told not to think.
    for parser in ("qwen3", None):
        served = chat_for_worker(chat, off, details(parser))
        assert served.chat_template_kwargs == THINKING_OFF == {"enable_thinking": False}
        mode = reasoning_mode(parser, served.chat_template_kwargs)
        assert mode is None or mode.thinking is False
    # A stock FastChat worker takes no template variables and announces no thoughts: as before.
    assert chat_for_worker(chat, off, details(None, frozenset())) is chat
    # DeepSeek-R1 always thinks: refused, not silently thinking anyway.
    with pytest.raises(InvalidRequestError) as caught:
        chat_for_worker(chat, off, details("deepseek_r1"))
    assert caught.value.param == "thinking.type" and "always thinks" in caught.value.message
    # Thinking on (or the default) leaves the request as it was.
    assert chat_for_worker(chat, Thinking("default"), details("qwen3")) is chat
    assert chat_for_worker(chat, Thinking("on"), details("deepseek_r1")) is chat
    with pytest.raises(InvalidRequestError) as caught:
        chat_for_worker(chat, Thinking("on"), details(None))
    assert caught.value.param == "thinking.type" and "does not think" in caught.value.message


# ---- the thinking block ---------------------------------------------------------------------------


def reply(*, parser: str | None = "qwen3", thinking: bool = True, tools: bool = False,
          omit: bool = False, **fields: Any) -> MessagesReply:
    constraint = (WorkerConstraint(None, [], TOOL_CALL_FORMATS["hermes"], ("get_weather",)) if tools
                  else WorkerConstraint(None, None, None))
    kwargs = None if thinking else THINKING_OFF
    prepared = ChatPrepared(0, constraint, reasoning_mode(parser, kwargs))
    return MessagesReply(body(**fields), "msg_1", prepared=lambda: prepared, omit_thoughts=omit)


async def events_of(messages_reply: MessagesReply, frames: list[Any]) -> list[dict[str, Any]]:
    events = []
    async for raw in messages_reply.events(FakeStreams(frames)):  # type: ignore[arg-type]
        name, data = raw.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def accumulated(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a client builds from the events (as the anthropic client's stream
    accumulates them: deltas appended to the block at their index)."""
    blocks: list[dict[str, Any]] = []
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            field = {"thinking_delta": "thinking", "signature_delta": "signature",
                     "text_delta": "text", "input_json_delta": "partial_json"}[delta["type"]]
            block[field] = (block.get(field, "") if field != "signature" else "") + delta[field]
    for block in blocks:
        if "partial_json" in block:
            block["input"] = json.loads(block.pop("partial_json"))
    return blocks


# The thoughts' tags split across chunks, as a tokenizer may deliver them.
THOUGHTS = ["<thi", "nk>Two and", " two.</th", "ink>\n\n", "Four", "."]


async def test_thoughts_are_a_thinking_block_ahead_of_the_text() -> None:
    frames = chunks(THOUGHTS)
    message = reply().response([whole(frames)])
    assert [block.model_dump() for block in message.content] == [
        {"type": "thinking", "thinking": "Two and two.", "signature": ""},
        {"type": "text", "text": "Four."}]
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == len(THOUGHTS)

    events = await events_of(reply(), frames)
    assert [e["type"] for e in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [e["delta"]["type"] for e in events[3:6]] == ["thinking_delta", "thinking_delta",
                                                         "signature_delta"]
    assert events[5]["delta"] == {"type": "signature_delta", "signature": ""}
    assert events[7] == {"type": "content_block_start", "index": 1,
                         "content_block": {"type": "text", "text": ""}}
    assert accumulated(events) == [block.model_dump() for block in message.content]


async def test_thoughts_then_a_tool_call() -> None:
    frames = chunks(["Weather", " needed.</think>", "\n", CALL[:30], CALL[30:]])
    message = reply(tools=True).response([whole(frames)])
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "Weather needed."
    assert message.content[1].input == {"city": "Oslo"} and message.stop_reason == "tool_use"
    events = await events_of(reply(tools=True), frames)
    blocks = accumulated(events)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[0] == message.content[0].model_dump()
    assert blocks[1]["input"] == {"city": "Oslo"} and blocks[1]["name"] == "get_weather"
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


async def test_thoughts_cut_by_max_tokens_are_all_there_is() -> None:
    frames = chunks(["Hmm, let", " me think </th"], reason="length")
    message = reply().response([whole(frames)])
    # The partial tag is neither thoughts nor answer; there is no text block.
    assert [block.model_dump() for block in message.content] == [
        {"type": "thinking", "thinking": "Hmm, let me think ", "signature": ""}]
    assert message.stop_reason == "max_tokens"
    events = await events_of(reply(), frames)
    assert accumulated(events) == [block.model_dump() for block in message.content]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


async def test_display_omitted_keeps_the_block_without_its_text() -> None:
    frames = chunks(THOUGHTS)
    message = reply(omit=True).response([whole(frames)])
    assert [block.model_dump() for block in message.content] == [
        {"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "Four."}]
    events = await events_of(reply(omit=True), frames)
    assert "thinking_delta" not in [e["delta"]["type"] for e in events if "delta" in e
                                    and "type" in e["delta"]]
    assert accumulated(events) == [block.model_dump() for block in message.content]


async def test_no_thoughts_no_thinking_block() -> None:
    # Thinking disabled (qwen3: the template wrote an empty block): all answer, tags and all.
    frames = chunks(["Four", "."])
    for messages_reply in (reply(thinking=False), reply(parser=None)):
        assert [b.type for b in messages_reply.response([whole(frames)]).content] == ["text"]
    events = await events_of(reply(thinking=False), frames)
    assert accumulated(events) == [{"type": "text", "text": "Four."}]
    # A reasoning model that closed its thoughts at once: no empty thinking block.
    empty = chunks(["</think>", "\n\nFour."])
    assert [b.type for b in reply().response([whole(empty)]).content] == ["text"]
    assert accumulated(await events_of(reply(), empty)) == [{"type": "text", "text": "Four."}]
