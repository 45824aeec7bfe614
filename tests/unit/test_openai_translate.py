"""The gateway's pure request side: request parsing, params translation and what it refuses.
(Its response side, deltas and error mapping, is in test_openai_responses.py.)"""

from __future__ import annotations

import json

import pytest

from llmplatform.errors import ContextLengthExceededError, InvalidRequestError
from llmplatform.openai_api import fastchat_peer
from llmplatform.utils.json_body import param_path, parse_json_body
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.openai_api.translate import (
    chat_messages,
    check_chat_request,
    check_unsupported,
    check_worker_extensions,
    completion_prompts,
    merge_stops,
    params_dict,
    worker_params,
)
from llmplatform.protocol.openai import ChatCompletionRequest, CompletionRequest
from llmplatform.protocol.worker import OpenAIMaxTokens, WorkerParams
from llmplatform.sampling.context_length import resolve_max_new_tokens


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_json_body(ChatCompletionRequest, json.dumps(body).encode())


def completion(**fields: object) -> CompletionRequest:
    body = {"model": "m", "prompt": "Once", **fields}
    return parse_json_body(CompletionRequest, json.dumps(body).encode())


BUDGET = OpenAIMaxTokens(requested=5)


# ---- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5}', "temperature"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": -0.1}', "temperature"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}', "top_p"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 129}', "n"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": 1}', "stream"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}', "top_logprobs"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 3}', "stop"),
    ],
)
def test_bad_chat_bodies_are_400_with_param(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_body(ChatCompletionRequest, raw)
    assert info.value.http_status == 400
    assert info.value.param == param


def test_completion_logprobs_range() -> None:
    with pytest.raises(InvalidRequestError) as info:
        completion(logprobs=21)
    assert info.value.param == "logprobs"
    assert completion(logprobs=5).logprobs == 5


def test_nulls_mean_defaults_and_unknown_fields_are_ignored() -> None:
    req = chat(temperature=None, top_p=None, n=None, stop=None, stream=None, user="u", tools=None)
    params = worker_params(req, prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.stop is None


def test_param_path() -> None:
    assert param_path(("messages", 0, "content", "str")) == "messages[0].content"
    assert param_path(("prompt", "list[str]", 0)) == "prompt[0]"
    assert param_path(()) == ""


# ---- messages and prompts -----------------------------------------------------------------------


def test_chat_messages_normalized() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert chat_messages(req.messages) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0].type"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{}"}}]}, "messages[0].tool_calls"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
    ],
)
def test_bad_messages(message: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat_messages(chat(messages=[message]).messages)
    assert info.value.param == param


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_chat_request(chat(top_logprobs=2))
    assert info.value.param == "top_logprobs"
    check_chat_request(chat(logprobs=True, top_logprobs=2))


def test_completion_prompts() -> None:
    assert completion_prompts(completion(prompt="x")) == ["x"]
    assert completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    for bad in ([1, 2], [[1, 2]], []):
        with pytest.raises(InvalidRequestError) as info:
            completion_prompts(completion(prompt=bad))
        assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        completion_prompts(completion(suffix="tail"))
    with pytest.raises(InvalidRequestError):
        completion_prompts(completion(best_of=3, n=2))


# ---- sizing --------------------------------------------------------------------------------------


def test_max_new_tokens_defaults() -> None:
    # chat: all the room left; completions: OpenAI's 16, clamped to the room left.
    assert resolve_max_new_tokens(None, prompt_tokens=10, context_length=100, default=None, prompt_param="messages") == 90
    assert resolve_max_new_tokens(None, prompt_tokens=10, context_length=100, default=16, prompt_param="prompt") == 16
    assert resolve_max_new_tokens(None, prompt_tokens=95, context_length=100, default=16, prompt_param="prompt") == 5
    assert resolve_max_new_tokens(90, prompt_tokens=10, context_length=100, default=None, prompt_param="messages") == 90


def test_context_overflow() -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        resolve_max_new_tokens(91, prompt_tokens=10, context_length=100, default=None, prompt_param="messages")
    assert info.value.openai_code == "context_length_exceeded"
    assert info.value.http_status == 400
    assert "maximum context length is 100 tokens" in info.value.message
    assert "you requested 101 tokens (10 in the messages, 91 in the completion)" in info.value.message
    with pytest.raises(ContextLengthExceededError):
        resolve_max_new_tokens(None, prompt_tokens=100, context_length=100, default=None, prompt_param="messages")


# ---- params --------------------------------------------------------------------------------------


def test_chat_worker_params() -> None:
    req = chat(
        max_completion_tokens=7,
        max_tokens=3,
        stop="END",
        seed=42,
        logprobs=True,
        top_logprobs=3,
        top_k=5,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[9],
    )
    messages = [{"role": "user", "content": "Hi"}]
    budget = OpenAIMaxTokens(requested=7, param="messages")
    params = worker_params(req, messages=messages, budget=budget, request_id="chatcmpl-x-1",
                           choice_index=1)
    wire = params_dict(params)
    assert wire["echo"] is False
    assert wire["messages"] == messages and "prompt" not in wire
    assert wire["openai_max_tokens"] == {"requested": 7, "param": "messages"}
    assert wire["max_new_tokens"] == 7
    assert wire["stop"] == ["END"]
    assert wire["stop_token_ids"] == [9]
    assert wire["seed"] == 43
    assert wire["logprobs"] == 3
    assert wire["top_k"] == 5
    assert wire["repetition_penalty"] == 1.1
    assert wire["ignore_eos"] is True and wire["min_tokens"] == 2
    assert wire["request_id"] == "chatcmpl-x-1"
    assert "prompt_logprobs" not in wire
    # A stock worker gets FastChat's form: the prompt rendered and sized, the template's stops.
    stock = fastchat_peer._stock(wire, "P", 6, ("<|im_end|>", "END"), (7,))
    assert stock["prompt"] == "P" and stock["max_new_tokens"] == 6
    assert "messages" not in stock and "openai_max_tokens" not in stock
    assert stock["stop"] == ["END", "<|im_end|>"] and stock["stop_token_ids"] == [9, 7]
    # The wire dict is what a worker parses: it round-trips.
    assert WorkerParams.model_validate(wire) == params


def test_chat_params_defaults_and_logprobs_zero() -> None:
    wire = params_dict(worker_params(chat(logprobs=True), prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0))
    assert wire["logprobs"] == 0
    assert wire["temperature"] == 1.0 and wire["top_k"] == -1 and "seed" not in wire
    wire = params_dict(worker_params(chat(), prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0))
    assert "logprobs" not in wire and wire["echo"] is False


def test_completion_params_echo_and_logprobs() -> None:
    wire = params_dict(
        worker_params(completion(echo=True, logprobs=2), prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0)
    )
    assert wire["echo"] is True and wire["logprobs"] == 2 and wire["prompt_logprobs"] == 2
    wire = params_dict(worker_params(completion(logprobs=2), prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0))
    assert wire["echo"] is False and wire["logprobs"] == 2 and "prompt_logprobs" not in wire


def test_logit_bias_is_forwarded_as_the_worker_reads_it() -> None:
    req = chat(logit_bias={"15": -100, "2": 100, "7": 0.5})
    params = worker_params(req, prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0)
    wire = params_dict(params)
    assert wire["logit_bias"] == {"15": -100.0, "2": 100.0, "7": 0.5}
    assert WorkerParams.model_validate(json.loads(json.dumps(wire))) == params
    for empty in (chat(), chat(logit_bias={}), chat(logit_bias=None)):
        wire = params_dict(worker_params(empty, prompt="PROMPT", budget=BUDGET, request_id="r", choice_index=0))
        assert "logit_bias" not in wire
    wire = params_dict(worker_params(completion(logit_bias={"3": 1}), prompt="PROMPT", budget=BUDGET,
                                         request_id="r", choice_index=0))
    assert wire["logit_bias"] == {"3": 1.0}


@pytest.mark.parametrize("raw, param", [
    ({"logit_bias": {"1": 101}}, "logit_bias.1"),
    ({"logit_bias": {"1": -100.5}}, "logit_bias.1"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1"),
    ({"logit_bias": {"1": True}}, "logit_bias.1"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": "1:5"}, "logit_bias"),
])
def test_logit_bias_values_are_checked_when_parsed(raw: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(**raw)
    assert info.value.param == param


@pytest.mark.parametrize("bias", [{"-1": 1}, {"abc": 1}, {"1.5": 1}, {"": 1}, {"１": 1},
                                  {"12345678901": 1}, {str(i): 1 for i in range(1025)}])
def test_logit_bias_keys_must_be_token_ids(bias: dict) -> None:
    for request in (chat(logit_bias=bias), completion(logit_bias=bias)):
        with pytest.raises(InvalidRequestError) as info:
            check_unsupported(request)
        assert info.value.param == "logit_bias"
    check_unsupported(chat(logit_bias={"0": -100, "4294967295": 100}))  # the worker checks the range


@pytest.mark.parametrize("field, value", [("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
                                          ("allowed_token_ids", []), ("bad_words", "x")])
def test_token_lists_we_do_not_serve_are_refused_not_dropped(field: str, value: object) -> None:
    for request in (chat(**{field: value}), completion(**{field: value})):
        with pytest.raises(InvalidRequestError) as info:
            check_unsupported(request)
        assert info.value.param == field
    check_unsupported(chat(allowed_token_ids=None, bad_words=None))  # null means "not given"


def test_logit_bias_needs_a_worker_that_announced_it() -> None:
    check_worker_extensions(chat(), frozenset())
    check_worker_extensions(chat(logit_bias={}), frozenset())
    check_worker_extensions(chat(logit_bias={"1": 5}), frozenset({"messages", "logit_bias"}))
    with pytest.raises(InvalidRequestError) as info:
        check_worker_extensions(chat(logit_bias={"1": 5}), frozenset({"messages", "openai_max_tokens"}))
    assert info.value.param == "logit_bias" and info.value.http_status == 400


def test_a_clients_cache_salt_needs_a_worker_that_announced_it() -> None:
    check_worker_extensions(completion(cache_salt="team-1"), frozenset({"cache_salt"}))
    for request in (chat(cache_salt="team-1"), completion(cache_salt="team-1")):
        with pytest.raises(InvalidRequestError) as info:
            check_worker_extensions(request, frozenset({"messages", "logit_bias"}))
        assert info.value.param == "cache_salt" and "does not support cache_salt" in info.value.message


def test_a_priority_needs_a_worker_that_announced_it() -> None:
    check_worker_extensions(chat(priority=-5), frozenset({"messages", "priority"}))
    check_worker_extensions(chat(priority=0), frozenset())  # everyone's default: nothing to drop
    for request in (chat(priority=3), completion(priority=-1)):
        with pytest.raises(InvalidRequestError) as info:
            check_worker_extensions(request, frozenset({"messages", "cache_salt", "n"}))
        assert info.value.param == "priority" and "does not support priority" in info.value.message
    assert params_dict(worker_params(chat(priority=-7), prompt="P", budget=BUDGET, request_id="r",
                                     choice_index=0))["priority"] == -7
    assert "priority" not in params_dict(worker_params(chat(priority=0), prompt="P", budget=BUDGET,
                                                       request_id="r", choice_index=0))


@pytest.mark.parametrize("value", [1.5, "1", True, 2**31])
def test_a_priority_is_a_32_bit_integer(value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(priority=value)
    assert info.value.param == "priority"
    assert chat(priority=-(2**31)).priority == -(2**31)


def test_seeds_stay_in_the_workers_range_for_every_choice() -> None:
    top = 2**64 - 1
    seeds = [params_dict(worker_params(chat(seed=top), prompt="PROMPT", budget=BUDGET, request_id="r",
                                     choice_index=i))["seed"] for i in range(3)]
    assert seeds == [top, 0, 1]  # seed + i modulo 2**64, as generators use it
    low = -(2**63)
    assert params_dict(worker_params(chat(seed=low), prompt="PROMPT", budget=BUDGET, request_id="r",
                                   choice_index=2))["seed"] == low + 2


def test_merge_stops() -> None:
    assert merge_stops(None) is None
    assert merge_stops("a", ["a", "b", ""]) == ["a", "b"]
    assert merge_stops(["x", "y"]) == ["x", "y"]


@pytest.mark.parametrize("field, value", [
    ("logits_processors", ["x"]), ("use_beam_search", True), ("include_stop_str_in_output", True),
])
def test_generation_constraints_we_do_not_serve_are_refused_not_dropped(field: str, value: object) -> None:
    for request in (chat(**{field: value}), completion(**{field: value})):
        with pytest.raises(InvalidRequestError) as info:
            check_unsupported(request)
        assert info.value.param == field


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "x"}),
])
def test_legacy_function_calling_and_audio_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_unsupported(chat(**{field: value}))
    assert info.value.param == field


def test_neutral_values_of_unserved_fields_ask_for_nothing() -> None:
    check_unsupported(chat(functions=[], function_call="none", use_beam_search=False,
                           modalities=["text"], include_stop_str_in_output=False))


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}
SERVING = frozenset({"messages", "structured_output", "tools"})


@pytest.mark.parametrize("field, value, extension", [
    ("response_format", {"type": "json_object"}, "structured_output"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
     "structured_output"),
    ("guided_json", {"type": "object"}, "structured_output"),
    ("guided_regex", "a+", "structured_output"), ("guided_choice", ["a", "b"], "structured_output"),
    ("guided_grammar", "root ::= 'a'", "structured_output"),
    ("structured_outputs", {"regex": "a"}, "structured_output"),
])
def test_output_constraints_need_a_worker_that_announced_them(field: str, value: object,
                                                              extension: str) -> None:
    for request in (chat(**{field: value}), completion(**{field: value})):
        check_unsupported(request)
        constraints = request_constraints(request)
        with pytest.raises(InvalidRequestError) as info:  # a stock FastChat worker
            constraints.for_worker("m", frozenset(), None)
        assert info.value.param == field.split(".")[0] or info.value.param.startswith(field)
        assert "does not support" in info.value.message
        constraint = constraints.for_worker("m", SERVING, "hermes")
        assert constraint.structured_output["param"].startswith(field)
        assert constraint.tools is None and constraint.new_parser() is None


def test_tools_need_a_tool_capable_worker_and_force_calls_in_its_syntax() -> None:
    required = request_constraints(chat(tools=[TOOL], tool_choice="required"))
    for announced, parser in ((frozenset({"structured_output"}), None), (SERVING, None)):
        with pytest.raises(InvalidRequestError) as info:
            required.for_worker("m", announced, parser)
        assert info.value.param == "tools"
    constraint = required.for_worker("m", SERVING, "llama3_json")
    assert constraint.structured_output["type"] == "structural_tag"
    assert '\\"parameters\\": ' in constraint.structured_output["source"]
    assert constraint.tools == [TOOL]
    auto = request_constraints(chat(tools=[TOOL])).for_worker("m", SERVING, "hermes")
    assert auto.structured_output is None and auto.new_parser() is not None
    none = request_constraints(chat(tools=[TOOL], tool_choice="none"))
    assert none.for_worker("m", frozenset(), None).tools is None  # nothing asked of the worker


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "not": {}}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_tools_and_constraints_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request_constraints(chat(**fields))
    assert info.value.param == param


def test_tool_history_needs_a_tool_capable_worker() -> None:
    history = chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}])
    messages = chat_messages(history.messages)
    assert messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c"}
    with pytest.raises(InvalidRequestError) as info:
        request_constraints(history).for_worker("m", frozenset({"structured_output"}), None)
    assert info.value.param == "messages"
