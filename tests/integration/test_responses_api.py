"""OpenAI's Responses API end to end: the default model (SmolLM2-135M-Instruct, paged engine)
behind a real controller, worker and gateway on 127.0.0.1, driven with the official openai
client (and the OpenAI Agents SDK), stored responses in a real SQLite file.

Greedy answers are compared with the chat endpoint's for the same conversation: the Responses
endpoint is served on the chat path, so they must be equal token for token.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import Cluster

pytestmark = pytest.mark.slow  # the real default model

MODEL = "smol"
KEY_A, KEY_B = "key-a", "key-b"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather",
                                              "description": "The weather in a city.",
                                              "parameters": WEATHER}}


class Stack:
    def __init__(self, stack: contextlib.ExitStack, controller_url: str, store: Path) -> None:
        self.stack, self.controller_url, self.store = stack, controller_url, store

    @contextlib.contextmanager
    def gateway(self, store: Path | None = None, **settings: Any) -> Iterator[str]:
        app = create_gateway_app(GatewaySettings(
            controller_address=self.controller_url, api_keys=(KEY_A, KEY_B),
            responses_store=str(store or self.store), **settings))
        with serve_in_thread(app) as url:
            yield url


def client_for(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    llm = build_backend(BackendConfig(model_path=str(default_model_dir), model_names=(MODEL,),
                                      device="cpu", dtype="float32", kv_cache_memory="256MiB",
                                      max_concurrency=4, max_model_len=1024))
    with contextlib.ExitStack() as exits:
        controller_url = exits.enter_context(serve_in_thread(create_controller_app(ControllerConfig())))
        Cluster(controller_url, "", stack=exits).add_worker(llm)
        yield Stack(exits, controller_url, tmp_path_factory.mktemp("responses") / "store.sqlite3")


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Iterator[str]:
    with stack.gateway() as url:
        yield url


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return client_for(gateway)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kwargs)


def test_text_and_instructions_equal_chat(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=16,
                                    temperature=0)
    same = chat(client, [{"role": "user", "content": "Name a colour."}], 16)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == same.choices[0].message.content
    assert reply.status == ("incomplete" if same.choices[0].finish_reason == "length" else "completed")
    assert reply.usage.input_tokens == same.usage.prompt_tokens
    assert reply.usage.output_tokens == same.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant"

    instructed = client.responses.create(model=MODEL, instructions="Answer in French.",
                                         input=[{"role": "user", "content": [
                                             {"type": "input_text", "text": "Say hello."}]}],
                                         max_output_tokens=16, temperature=0)
    same = chat(client, [{"role": "system", "content": "Answer in French."},
                         {"role": "user", "content": "Say hello."}], 16)
    assert instructed.output_text == same.choices[0].message.content
    assert instructed.instructions == "Answer in French."


def test_streamed_events_in_order(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=12,
                                    temperature=0)
    events = list(client.responses.create(model=MODEL, input="Count to five.",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", final])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[0].response.id == events[-1].response.id
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    # Stored like a non-streamed one.
    assert client.responses.retrieve(events[-1].response.id).output_text == text

    with client.responses.stream(model=MODEL, input="Count to five.", max_output_tokens=12,
                                 temperature=0) as stream:
        assert list(stream)[-1].response.output_text == text


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="What is my name?", max_output_tokens=12, temperature=0)
    same = chat(client, [{"role": "user", "content": "My name is Ada. Say hi."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}], 12)
    assert second.output_text == same.choices[0].message.content
    assert second.previous_response_id == first.id
    # The whole first exchange is in the second prompt: more than its own prompt and answer.
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]  # its own input only
    assert items.data[0].content[0].text == "What is my name?"


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    ask = "What is the weather in Paris?"
    called = client.responses.create(model=MODEL, input=ask, tools=[TOOL], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    answered = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[TOOL], max_output_tokens=24,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                               "output": "Sunny, 21 C"}])
    same = chat(client, [{"role": "user", "content": ask},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
                24, tools=[CHAT_TOOL])
    message = same.choices[0].message
    assert answered.output_text == (message.content or "")
    assert [i.type for i in answered.output] == (["message"] if message.content else []) + [
        "function_call"] * len(message.tool_calls or [])

    events = list(client.responses.create(model=MODEL, input=ask, tools=[TOOL],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=60, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(e.delta for e in events
                                     if e.type == "response.function_call_arguments.delta")
    assert done.arguments == call.arguments
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]


class Profile(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def test_structured_outputs(client: openai.OpenAI) -> None:
    schema = Profile.model_json_schema()
    schema["additionalProperties"] = False
    reply = client.responses.create(
        model=MODEL, input="Invent a person.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "profile", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), schema)
    assert reply.text.format.type == "json_schema"
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Profile,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Profile)
    as_object = client.responses.create(model=MODEL, input="Give me JSON about a cat.",
                                        text={"format": {"type": "json_object"}},
                                        max_output_tokens=40, temperature=0)
    if as_object.status == "completed":
        assert isinstance(json.loads(as_object.output_text), dict)


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Write a long story about a dragon.",
                                    max_output_tokens=4, temperature=0)
    assert reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 4 and reply.output[0].status == "incomplete"


def test_store_delete_and_tenants(gateway: str) -> None:
    a, b = client_for(gateway, KEY_A), client_for(gateway, KEY_B)
    kept = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
    assert a.responses.retrieve(kept.id).id == kept.id
    # Another key sees nothing: not the response, not as a conversation to continue.
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError) as caught:
        b.responses.create(model=MODEL, previous_response_id=kept.id, input="And?", max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(kept.id)

    unstored = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)

    a.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.delete(kept.id)


def test_a_restart_keeps_stored_responses_and_retention_is_bounded(stack: Stack, tmp_path: Path) -> None:
    store = tmp_path / "restart.sqlite3"
    with stack.gateway(store) as url:
        first = client_for(url).responses.create(model=MODEL, input="My name is Ada. Say hi.",
                                                 max_output_tokens=12, temperature=0)
    with stack.gateway(store) as url:  # a new gateway process state, the same file
        again = client_for(url)
        assert again.responses.retrieve(first.id).output_text == first.output_text
        follow = again.responses.create(model=MODEL, previous_response_id=first.id,
                                        input="What is my name?", max_output_tokens=8)
        assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    with stack.gateway(tmp_path / "bounded.sqlite3", responses_max_count=2) as url:
        bounded = client_for(url)
        ids = [bounded.responses.create(model=MODEL, input=f"Say {n}.", max_output_tokens=2).id
               for n in range(3)]
        with pytest.raises(openai.NotFoundError):
            bounded.responses.retrieve(ids[0])
        assert [bounded.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi"}, "model"),
    ({"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input[0].content[0].type"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "output": "1"}]},
     "input[0].call_id"),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": MODEL, "input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"model": MODEL, "input": "hi", "background": True}, "background"),
    ({"model": MODEL, "input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                         "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "hi", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "input": []}, "input"),
])
def test_bad_input_is_a_400_envelope(gateway: str, body: dict[str, Any], param: str) -> None:
    answer = httpx.post(f"{gateway}/v1/responses", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY_A}"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert httpx.post(f"{gateway}/v1/responses", content=b"{not json", timeout=60,
                      headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 400


def test_an_agents_sdk_agent_with_a_function_tool(gateway: str) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # nothing leaves 127.0.0.1
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny and 21 C in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{gateway}/v1", api_key=KEY_A, max_retries=0))
    # One call, whose result is the answer: a small model left free after its tool's result
    # may call again and again, which would test the model, not the endpoint.
    agent = agents.Agent(name="weather", instructions="Use the tool.", model=model,
                         tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(
                             tool_choice="required", parallel_tool_calls=False, temperature=0,
                             max_tokens=60))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1, calls
    assert result.final_output == f"Sunny and 21 C in {calls[0]}."
    [response] = result.raw_responses
    assert response.response_id.startswith("resp_")
