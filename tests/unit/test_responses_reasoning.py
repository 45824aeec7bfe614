"""A reasoning model's thoughts in the Responses dialect: a ``reasoning`` item ahead of the
message and calls, streamed as ``response.reasoning_text.*`` events, from the real chat reply
fed scripted worker chunks; and ``reasoning.effort`` checked and translated. Every item and
event is read back with the openai client's own types (a whole response is not: the client's
usage has a field, ``cache_write_tokens``, this server does not send)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.responses import ResponseOutputItem, ResponseReasoningItem, ResponseStreamEvent
from pydantic import TypeAdapter

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.chat import ChatPrepared, chat_reply
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.openai_api.reasoning import reasoning_mode
from llmplatform.openai_api.responses import ResponsesReply, output_items
from llmplatform.openai_api.responses_input import (
    chat_messages_of,
    chat_request,
    check_refused,
    thinking_off_for_worker,
    normalise_items,
    renamed,
)
from llmplatform.openai_api.worker_details import ModelDetails
from llmplatform.protocol.openai import ChatResponseMessage, ResponseFunctionCall, ResponseToolCall
from llmplatform.protocol.responses import ResponseObject, ResponsesRequest
from llmplatform.protocol.worker import ChunkUsage, WorkerChunk
from llmplatform.utils.json_body import parse_json_body

EVENTS = TypeAdapter(ResponseStreamEvent)
ITEM = TypeAdapter(ResponseOutputItem)
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
THOUGHTS = "The user wants the weather. <tool_call> is how I would call it, later."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class _Streams:
    """One choice's worker chunks, the text cut at `cuts` (deltas, as our workers send)."""

    num_choices = 1

    def __init__(self, text: str, cuts: list[int], reason: str = "stop") -> None:
        self._text, self._cuts, self._reason = text, cuts, reason

    async def events(self):
        ends = [*self._cuts, len(self._text)]
        for i, (start, end) in enumerate(zip([0, *ends], ends)):
            final = i == len(ends) - 1
            yield 0, WorkerChunk(text=self._text[start:end], delta=True,
                                 usage=ChunkUsage(prompt_tokens=3, completion_tokens=i + 1),
                                 finish_reason=self._reason if final else None)

    def cancel(self) -> None:
        pass


def _reply(stream: bool, *, tools: bool = False, **fields: Any) -> ResponsesReply:
    """The Responses reply to a request on a ``qwen3`` reasoning worker with hermes tools."""
    body = ResponsesRequest.model_validate({"model": "m", "input": "x", "stream": stream,
                                            **({"tools": TOOLS} if tools else {}), **fields})
    chat = chat_request(body, "m", normalise_items(body.input))
    reasoning = reasoning_mode("qwen3", chat.chat_template_kwargs)
    constraint = request_constraints(chat).for_worker(
        "m", frozenset({"structured_output", "tools"}), "hermes", thinking=reasoning.thinking)
    prepared = ChatPrepared(0, constraint, reasoning)
    shell = ResponseObject(id="resp_1", created_at=0, status="in_progress", model="m")
    return ResponsesReply(chat_reply(chat)(lambda: prepared), shell, None)


def _whole(text: str, reason: str = "stop", **fields: Any) -> dict[str, Any]:
    final = WorkerChunk(text=text, finish_reason=reason,
                        usage=ChunkUsage(prompt_tokens=3, completion_tokens=9))
    return _reply(False, **fields).response([final]).model_dump()


def _streamed(text: str, cuts: list[int], reason: str = "stop", **fields: Any
              ) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        return [e async for e in _reply(True, **fields).events(_Streams(text, cuts, reason))]

    events = []
    for raw in asyncio.run(collect()):
        payload = json.loads(raw.decode().split("\n")[1].removeprefix("data: "))
        if "response" in payload:  # the lifecycle events: their output items
            for item in payload["response"]["output"]:
                ITEM.validate_python(item)
        else:
            EVENTS.validate_python(payload)  # the client's own type for each event
        events.append(payload)
    return events


def _items_of(events: list[dict[str, Any]]) -> tuple[str, str, list[dict[str, Any]]]:
    """What the deltas add up to: the thoughts, the text, and the final output items."""
    thoughts = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return thoughts, text, events[-1]["response"]["output"]


@pytest.mark.parametrize("cut", [1, 5, len(THOUGHTS) + 3, len(THOUGHTS) + 10, len(THOUGHTS) + 14])
def test_thoughts_are_a_reasoning_item_ahead_of_the_message(cut: int) -> None:
    text = f"{THOUGHTS}</think>\n\nIt is sunny."
    [reasoning, message] = _whole(text)["output"]
    ResponseReasoningItem.model_validate(reasoning)
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHTS}]
    assert reasoning["status"] == "completed"
    assert message["type"] == "message" and message["content"][0]["text"] == "It is sunny."

    events = _streamed(text, [cut])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * _count(events, "response.reasoning_text.delta"),
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * _count(events, "response.output_text.delta"),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    added, done = events[2], events[events.index(_first(events, "response.output_item.done"))]
    assert added["item"] == {"type": "reasoning", "id": added["item"]["id"], "summary": [],
                             "content": [], "status": "in_progress"}
    assert done["item"]["content"] == reasoning["content"] and done["item"]["status"] == "completed"
    assert _first(events, "response.reasoning_text.done")["text"] == THOUGHTS
    thoughts, answer, output = _items_of(events)
    assert (thoughts, answer) == (THOUGHTS, "It is sunny.")
    assert [(i["type"], i["status"]) for i in output] == [("reasoning", "completed"),
                                                          ("message", "completed")]
    assert output[0]["id"] == added["item"]["id"] and output[0]["content"] == reasoning["content"]


def _count(events: list[dict[str, Any]], kind: str) -> int:
    return sum(e["type"] == kind for e in events)


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(e for e in events if e["type"] == kind)


@pytest.mark.parametrize("cut", [4, len(THOUGHTS) + 12])
def test_thoughts_then_a_call(cut: int) -> None:
    text = f"{THOUGHTS}</think>\n\n{CALL}"
    output = _whole(text, tools=True)["output"]
    assert [i["type"] for i in output] == ["reasoning", "function_call"]
    assert output[0]["content"][0]["text"] == THOUGHTS  # the tag in the thoughts is no call
    assert output[1]["name"] == "get_weather" and output[1]["arguments"] == '{"city": "Oslo"}'
    thoughts, answer, streamed = _items_of(_streamed(text, [cut], tools=True))
    assert (thoughts, answer) == (THOUGHTS, "")
    assert [(i["type"], i["status"]) for i in streamed] == [("reasoning", "completed"),
                                                            ("function_call", "completed")]
    assert streamed[1]["arguments"] == output[1]["arguments"]


def test_thoughts_cut_by_max_output_tokens_are_an_incomplete_item() -> None:
    whole = _whole("Let me think about th", reason="length")
    assert whole["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in whole["output"]] == [("reasoning", "incomplete")]
    events = _streamed("Let me think about th", [7], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert _items_of(events)[0] == "Let me think about th"
    assert [(i["type"], i["status"]) for i in events[-1]["response"]["output"]] == [
        ("reasoning", "incomplete")]
    # Cut in the answer: the thoughts were finished, the message was not.
    cut = output_items(ChatResponseMessage(content="It is", reasoning_content="Hm."), "incomplete")
    assert [(i.type, i.status) for i in cut] == [("reasoning", "completed"), ("message", "incomplete")]


def test_no_thoughts_no_reasoning_item() -> None:
    assert [i["type"] for i in _whole("</think>Hi")["output"]] == ["message"]
    calls = [ResponseToolCall(id="call_1", function=ResponseFunctionCall(name="f", arguments="{}"))]
    assert [i.type for i in output_items(ChatResponseMessage(tool_calls=calls), "completed")] == [
        "function_call"]
    # effort "none": the template wrote an empty block; the whole output is the answer.
    off = _whole("<think>x</think>y", reasoning={"effort": "none"})
    assert [i["type"] for i in off["output"]] == ["message"]
    assert off["output"][0]["content"][0]["text"] == "<think>x</think>y"
    events = _streamed("a</think>b", [2], reasoning={"effort": "none"})
    assert _count(events, "response.reasoning_text.delta") == 0
    assert _items_of(events)[1] == "a</think>b"


def test_a_stored_reasoning_item_is_kept_but_not_shown_to_the_model() -> None:
    output = _whole(f"{THOUGHTS}</think>Sunny.")["output"]
    conversation = [*normalise_items("Weather?"), *output, *normalise_items("And tomorrow?")]
    assert chat_messages_of(conversation) == [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"}]
    # Sent back by a client that manages the context itself: kept as sent.
    assert normalise_items([output[0]])[0] == output[0]


def test_effort_none_is_served_as_enable_thinking_false() -> None:
    body = ResponsesRequest.model_validate({"model": "m", "input": "x",
                                            "reasoning": {"effort": "none"}})
    check_refused(body)
    assert chat_request(body, "m", normalise_items("x")).chat_template_kwargs == {
        "enable_thinking": False}
    plain = ResponsesRequest.model_validate({"model": "m", "input": "x", "reasoning": {}})
    check_refused(plain)
    assert chat_request(plain, "m", normalise_items("x")).chat_template_kwargs is None
    # A worker without the extension: chat's refusal, in the Responses request's words.
    assert renamed(InvalidRequestError("x", param="chat_template_kwargs")).param == "reasoning.effort"


@pytest.mark.parametrize(("reasoning", "param"), [
    ({"effort": "high"}, "reasoning.effort"),
    ({"effort": "minimal"}, "reasoning.effort"),
    ({"effort": "extreme"}, "reasoning.effort"),
    ({"effort": "none", "summary": "auto"}, "reasoning.summary"),
    ({"generate_summary": "concise"}, "reasoning.generate_summary"),
    ({"context": "all_turns"}, "reasoning.context"),
    ({"mode": "pro"}, "reasoning.mode"),
])
def test_unserved_reasoning_settings_are_named(reasoning: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_refused(ResponsesRequest.model_validate({"model": "m", "reasoning": reasoning}))
    assert caught.value.param == param
    check_refused(ResponsesRequest.model_validate({"model": "m", "reasoning": {
        "effort": None, "summary": None, "context": "current_turn", "mode": "standard"}}))


def test_unknown_reasoning_settings_are_named() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_json_body(ResponsesRequest, b'{"model": "m", "reasoning": {"budget": 100}}')
    assert caught.value.param == "reasoning.budget"
    with pytest.raises(InvalidRequestError) as caught:
        parse_json_body(ResponsesRequest, b'{"model": "m", "reasoning": "high"}')
    assert caught.value.param == "reasoning"


def _details(reasoning_parser: str | None,
             extensions: frozenset[str] = frozenset({"chat_template_kwargs"})) -> ModelDetails:
    return ModelDetails(context_length=8, extensions=extensions, tool_call_parser=None,
                        reasoning_parser=reasoning_parser, raw={})


def test_effort_none_is_refused_where_the_model_always_thinks() -> None:
    chat = chat_request(ResponsesRequest.model_validate(
        {"model": "r1", "input": "Hi", "reasoning": {"effort": "none"}}), "r1", normalise_items("Hi"))
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    for_worker = thinking_off_for_worker(chat)
    # No thoughts to turn off: the template may still read the switch.
    assert for_worker(_details(None)).chat_template_kwargs == {"enable_thinking": False}
    assert for_worker(_details("qwen3")).chat_template_kwargs == {"enable_thinking": False}
    # A stock FastChat worker takes no template variables: the request goes without them.
    assert for_worker(_details(None, frozenset())).chat_template_kwargs is None
    with pytest.raises(InvalidRequestError) as caught:
        for_worker(_details("deepseek_r1"))
    assert caught.value.param == "reasoning.effort" and "'r1'" in caught.value.message
