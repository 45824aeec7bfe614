"""Messages requests -> the chat request that serves them (messages_translate), and what is
refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.messages_translate import (
    chat_messages_of, chat_request, check_stop_sequences,
)
from llmplatform.openai_api.settings import RequestLimits
from llmplatform.protocol.anthropic import CountTokensRequest, MessagesRequest

USER = {"role": "user", "content": "Hi"}


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16, "messages": [USER], **fields})


def refused(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        chat_request(request(**fields))
    return caught.value


def test_a_conversation_with_a_tool_round_trip_becomes_chat_messages() -> None:
    body = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                   messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Oslo."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
            {"type": "text", "text": "Thanks"}]}])
    assert chat_messages_of(body) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?\nIn Oslo."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "Thanks"}]


def test_sampling_tools_and_choice_map_onto_chat_fields() -> None:
    chat = chat_request(request(
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=40, stream=True,
        metadata={"user_id": "u-1"},
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}, "cache_control": {}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.stream, chat.user) == (
        16, ["END"], 0.5, 0.9, 40, True, "u-1")
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "description": "d"}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    assert chat_request(request(tools=tools, tool_choice={"type": "tool", "name": "f"})).tool_choice == {
        "type": "function", "function": {"name": "f"}}
    assert chat_request(request(tools=tools, tool_choice={"type": "none"})).tool_choice == "none"
    assert chat_request(request(tools=tools)).tool_choice is None  # chat's default: auto with tools


def test_count_tokens_requests_translate_without_output_fields() -> None:
    chat = chat_request(CountTokensRequest.model_validate({"model": "m", "messages": [USER], "system": "S"}))
    assert chat.max_tokens is None and chat.stop is None
    assert [m.role for m in chat.messages] == ["system", "user"]


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}, USER]},
     "messages[0].content[0].input"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
    ({"messages": [USER, {"role": "assistant", "content": "Sure,"}]}, "messages[1].role"),
    ({"system": [{"type": "image", "source": {}}]}, "system[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "16"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"thinking": {"type": "adaptive", "display": "full"}}, "thinking.display"),
    ({"thinking": True}, "thinking"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
])
def test_what_is_not_served_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    error = refused(**fields)
    assert error.param == param and param in error.message


def test_disabled_thinking_and_empty_extras_are_accepted() -> None:
    chat = chat_request(request(thinking={"type": "disabled"}, mcp_servers=[], output_config={}))
    assert chat.messages[0].content == "Hi"


def test_stop_sequences_are_checked_against_the_limits_under_their_own_name() -> None:
    limits = RequestLimits(max_stop_sequences=2, max_stop_length=5)
    check_stop_sequences(request(stop_sequences=["a", "bb"]), limits)
    for stops in (["a", "b", "c"], [""], ["toolong"]):
        with pytest.raises(InvalidRequestError) as caught:
            check_stop_sequences(request(stop_sequences=stops), limits)
        assert caught.value.param == "stop_sequences"


def test_max_tokens_is_required_and_positive() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"model": "m", "messages": [USER]})
    with pytest.raises(ValidationError):
        request(max_tokens=0)


def test_fields_anthropic_does_not_define_are_refused_by_name_and_informational_ones_ignored() -> None:
    from llmplatform.utils.json_body import parse_json_body

    for extra in ("seed", "logit_bias", "frequency_penalty", "n"):
        for model, body in ((MessagesRequest, {"max_tokens": 16}), (CountTokensRequest, {})):
            raw = json.dumps({"model": "m", "messages": [USER], **body, extra: 1}).encode()
            with pytest.raises(InvalidRequestError) as caught:
                parse_json_body(model, raw)
            assert caught.value.param == extra and extra in caught.value.message
    informational = {"service_tier": "auto", "inference_geo": "us", "speed": "standard",
                     "diagnostics": {}, "cache_control": {"type": "ephemeral"}}
    assert chat_request(request(**informational)).messages[0].content == "Hi"
