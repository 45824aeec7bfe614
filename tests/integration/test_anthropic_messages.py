"""Anthropic's Messages API end to end: the official ``anthropic`` client against a real gateway,
controller and worker serving the default model (SmolLM2-135M-Instruct, its tool-calling
template), behind an API key. Greedy replies are compared with what the chat completion route
answers for the same prompt: both are the one chat path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from tests.integration.cluster import Cluster, running_cluster

pytestmark = pytest.mark.slow  # the real default model

MODEL = "smol"
KEY = "sk-messages-test"
GREEDY = {"temperature": 0.0}  # not a parameter of this client version's create(): sent as is
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "input_schema": WEATHER}]
FORCED = {"type": "tool", "name": "get_weather"}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def cluster(default_model_dir: Any) -> Iterator[Cluster]:
    llm = build_backend(BackendConfig(model_path=str(default_model_dir), model_names=(MODEL,),
                                      backend="paged", device="cpu", dtype="bfloat16",
                                      kv_cache_memory="256MiB", max_model_len=1024))
    with running_cluster(api_keys=(KEY,)) as cluster:
        cluster.add_worker(llm)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.gateway_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key=KEY, max_retries=0, timeout=300)


def test_text_whole_and_streamed_equal_the_chat_completion(client, chat) -> None:
    expected = chat.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    message = client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens

    with client.messages.stream(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == message.usage.input_tokens
    assert final.usage.output_tokens == message.usage.output_tokens


def test_the_raw_stream_is_anthropics_event_sequence(cluster: Cluster) -> None:
    with httpx.stream("POST", f"{cluster.gateway_url}/v1/messages", timeout=300,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "max_tokens": 5, "messages": QUESTION, "stream": True,
                            **GREEDY}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = [block.split("\n") for block in body.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    datas = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [d["type"] for d in datas] == names  # each event's name is its data's type
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"] == {"output_tokens": 5}
    assert "[DONE]" not in body


def test_stop_sequences_and_max_tokens_stop_reasons(client) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY)
    text = whole.content[0].text
    stop = "Paris"
    cut = client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, stop_sequences=["zebra", stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert [b.text for b in cut.content if b.type == "text"] in ([text[:text.index(stop)]], [])
    with client.messages.stream(model=MODEL, max_tokens=30, messages=QUESTION, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop

    short = client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_system_prompt_string_and_blocks(client, chat) -> None:
    system = "You are a pirate. Answer like one."
    expected = chat.chat.completions.create(
        model=MODEL, max_tokens=20, temperature=0,
        messages=[{"role": "system", "content": system}, *QUESTION]).choices[0].message.content
    as_string = client.messages.create(model=MODEL, max_tokens=20, system=system, messages=QUESTION,
                                       extra_body=GREEDY)
    as_blocks = client.messages.create(model=MODEL, max_tokens=20, messages=QUESTION, extra_body=GREEDY,
                                       system=[{"type": "text", "text": system}])
    assert as_string.content[0].text == as_blocks.content[0].text == expected


def test_a_tool_round_trip(client) -> None:
    first = client.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_QUESTION, tools=TOOLS,
                                   tool_choice=FORCED, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)

    # Streamed: the call's input arrives as input_json_delta pieces and adds up to the same input.
    with client.messages.stream(model=MODEL, max_tokens=60, messages=WEATHER_QUESTION, tools=TOOLS,
                                tool_choice=FORCED, extra_body=GREEDY) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert final.stop_reason == "tool_use"
    assert final.content[-1].input == call.input and final.content[-1].name == "get_weather"

    history = [*WEATHER_QUESTION,
               {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees, clear sky"}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in second.content] == ["text"] and second.content[0].text
    # The result reached the prompt: it is longer than the history without it.
    without = client.messages.count_tokens(model=MODEL, messages=history[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": ""}]}],
        tools=TOOLS, tool_choice={"type": "none"})
    assert second.usage.input_tokens > without.input_tokens


def test_count_tokens_equals_what_the_generation_reports(client) -> None:
    for kwargs in ({"messages": QUESTION},
                   {"messages": QUESTION, "system": "Be brief."},
                   {"messages": WEATHER_QUESTION, "tools": TOOLS}):
        counted = client.messages.count_tokens(model=MODEL, **kwargs)
        generated = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, **kwargs)
        assert counted.input_tokens == generated.usage.input_tokens > 0, kwargs
    with_tools = client.messages.count_tokens(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS)
    without = client.messages.count_tokens(model=MODEL, messages=WEATHER_QUESTION)
    assert with_tools.input_tokens > without.input_tokens  # the tools are in the prompt


def test_keys_by_x_api_key_or_bearer(cluster: Cluster) -> None:
    wrong = anthropic.Anthropic(base_url=cluster.gateway_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=QUESTION)
    assert refused.value.status_code == 401
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=QUESTION)
    bearer = anthropic.Anthropic(base_url=cluster.gateway_url, auth_token=KEY, max_retries=0, timeout=300)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).usage.output_tokens == 2
    # The chat route keeps OpenAI's envelope for the same refusal.
    response = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", headers={"x-api-key": "sk-wrong"},
                          json={"model": MODEL, "messages": QUESTION})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def _raw(cluster: Cluster, body: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{cluster.gateway_url}{path}", json=body, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})


@pytest.mark.parametrize("body, named", [
    ({"model": MODEL, "messages": QUESTION}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[1].type"),
    # A budget that constrains nothing, but the model does not think (no reasoning parser).
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking.type"),
    ({"model": MODEL, "max_tokens": 2048, "messages": QUESTION,
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": [*QUESTION, {"role": "assistant", "content": "The"}]},
     "messages[1].role"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION, "tools": [{"type": "web_search_20250305",
                                                                         "name": "web_search"}]},
     "tools[0].type"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION, "temperature": "hot"}, "temperature"),
])
def test_bad_input_is_an_invalid_request_error_naming_the_field(cluster: Cluster, client, body, named) -> None:
    response = _raw(cluster, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    if "max_tokens" in body and set(body) <= {"model", "max_tokens", "messages", "thinking", "tools"}:
        # the client's own exception class for it
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(**body)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
    # ...and the server keeps serving.
    assert client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).stop_reason == "max_tokens"


def test_unknown_model_and_route_refusals_are_anthropics(cluster: Cluster, client) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    response = _raw(cluster, {"model": MODEL, "messages": QUESTION}, "/v1/messages/batches")
    assert response.status_code in (404, 405)
    assert response.json()["error"]["type"] in ("not_found_error", "invalid_request_error")
    counted = _raw(cluster, {"model": MODEL}, "/v1/messages/count_tokens")
    assert counted.status_code == 400 and "messages" in counted.json()["error"]["message"]


def test_per_key_limits_and_a_stock_worker_answer_in_anthropics_shapes() -> None:
    """The per-key limit counts /v1/messages (a second request in flight is Anthropic's 429), on
    the fake stock worker (tests/fake_worker.py), which serves the Messages route too."""
    from llmplatform.openai_api.settings import TenantLimits
    from tests.security.test_tenant_limits import FAKE_MODEL, HOLD, tenant_cluster

    with tenant_cluster(api_keys=(KEY,), tenant_limits=TenantLimits(max_concurrent_requests=1)) as cluster:
        client = anthropic.Anthropic(base_url=cluster.gateway, api_key=KEY, max_retries=0, timeout=30)
        with client.messages.stream(model=FAKE_MODEL, max_tokens=8,
                                    messages=[{"role": "user", "content": HOLD}]) as held:
            events = iter(held)
            assert next(events).type == "message_start"
            with pytest.raises(anthropic.RateLimitError) as limited:
                client.messages.create(model=FAKE_MODEL, max_tokens=8, messages=QUESTION)
            assert limited.value.body["error"]["type"] == "rate_limit_error"
            assert int(limited.value.response.headers["retry-after"]) >= 1
            cluster.worker.release.set()
            assert held.get_final_message().stop_reason == "end_turn"
        answer = client.messages.create(model=FAKE_MODEL, max_tokens=8, messages=QUESTION)
        assert answer.content[0].type == "text" and answer.usage.input_tokens > 0
