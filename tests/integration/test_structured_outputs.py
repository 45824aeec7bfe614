"""Tools and structured outputs end to end: the default model (SmolLM2-135M-Instruct) behind a real
controller, worker and gateway, on both backends, driven with the official openai client.

Every constrained reply must parse and validate, not most: the grammar enforces it token by
token. Prompts run concurrently (the paged backend batches them) to keep the suite quick.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from llmplatform.llm.build import BackendConfig, build_backend
from tests.integration.cluster import Cluster, running_cluster

pytestmark = pytest.mark.slow  # the real default model

MODEL = "smol"
NUM_PROMPTS = 50  # the count, for tool_choice="required" on the paged backend
NUM_OTHER_PROMPTS = 16  # the other constraints (each reply checked all the same)
NUM_HF_PROMPTS = 2  # the hf backend runs one request at a time per thread: a sample (same grammars)
TOPICS = ["Paris", "a red bicycle", "the weather in Oslo", "two cats", "a birthday party",
          "a library book", "the moon", "an old train", "a chess game", "fresh bread"]

WEATHER = {"type": "object", "properties": {
    "location": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16}},
        "required": ["city", "country"], "additionalProperties": False},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"], "additionalProperties": False}
BOOKING = {"type": "object", "properties": {
    "guests": {"type": "integer", "minimum": 1, "maximum": 12},
    "when": {"type": "object", "properties": {
        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["day", "hour"], "additionalProperties": False},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
    "required": ["guests", "when"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 20},
    "filters": {"type": "object", "properties": {
        "lang": {"enum": ["en", "fr", "de"]},
        "safe": {"type": "boolean"}},
        "required": ["lang", "safe"], "additionalProperties": False}},
    "required": ["query", "filters"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "book_table": BOOKING, "search_web": SEARCH}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
PROFILE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "calm"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "mood", "address"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["paged", "hf"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(default_model_dir: Any, backend: str) -> Iterator[Cluster]:
    llm = build_backend(BackendConfig(model_path=str(default_model_dir), model_names=(MODEL,),
                                  backend=backend, device="cpu", dtype="bfloat16",
                                  kv_cache_memory="256MiB",
                                  # the paged engine runs each test's prompts as one batch
                                  max_concurrency=NUM_PROMPTS if backend == "paged" else 4,
                                  max_model_len=1024))
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client(timeout_s=900)


def num_prompts(backend: str, count: int = NUM_OTHER_PROMPTS) -> int:
    return count if backend == "paged" else NUM_HF_PROMPTS


def run_all(fn, count: int) -> list[Any]:
    with ThreadPoolExecutor(count) as pool:  # every request in one batch on the paged engine
        return list(pool.map(fn, range(count)))


def ask(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say something about {topic}."}]


def test_tool_choice_required_over_three_nested_tools(client: openai.OpenAI, backend: str) -> None:
    def one(i: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=ask(TOPICS[i % len(TOPICS)]), tools=TOOLS,
            tool_choice="required", max_tokens=200, temperature=0.8, seed=i,
            # With parallel calls allowed this small model goes on calling until max_tokens
            # cuts the last call; one call ends where its grammar does.
            parallel_tool_calls=False)

    for reply in run_all(one, num_prompts(backend, NUM_PROMPTS)):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool(client: openai.OpenAI, backend: str) -> None:
    def one(i: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=ask(TOPICS[i % len(TOPICS)]), tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "book_table"}},
            max_tokens=200, temperature=0.8, seed=i)

    for reply in run_all(one, num_prompts(backend)):
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in calls] == ["book_table"]
        jsonschema.validate(json.loads(calls[0].function.arguments), BOOKING)


def test_json_schema_and_json_object(client: openai.OpenAI, backend: str) -> None:
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}}

    def one(i: int) -> tuple[Any, Any]:
        messages = [{"role": "user", "content": f"Describe a person who likes "
                                                f"{TOPICS[i % len(TOPICS)]}, as JSON."}]
        with_schema = client.chat.completions.create(
            model=MODEL, messages=messages, response_format=schema_format, max_tokens=200,
            temperature=0.8, seed=i)
        any_object = client.chat.completions.create(
            model=MODEL, messages=messages, response_format={"type": "json_object"},
            max_tokens=60, temperature=0.8, seed=i)
        return with_schema, any_object

    for with_schema, any_object in run_all(one, num_prompts(backend)):
        assert with_schema.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(with_schema.choices[0].message.content), PROFILE)
        if any_object.choices[0].finish_reason == "stop":  # an open object may hit max_tokens
            assert isinstance(json.loads(any_object.choices[0].message.content), dict)
        else:
            assert any_object.choices[0].message.content.lstrip().startswith("{")


def test_guided_choice_and_regex_on_both_endpoints(client: openai.OpenAI, backend: str) -> None:
    choices = ["positive", "negative", "neutral"]
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{3}"

    def one(i: int) -> tuple[str, str, str]:
        topic = TOPICS[i % len(TOPICS)]
        picked = client.chat.completions.create(
            model=MODEL, messages=ask(topic), max_tokens=10, temperature=1.0, seed=i,
            extra_body={"guided_choice": choices})
        coded = client.chat.completions.create(
            model=MODEL, messages=ask(topic), max_tokens=20, temperature=1.0, seed=i,
            extra_body={"structured_outputs": {"regex": pattern}})
        completed = client.completions.create(
            model=MODEL, prompt=f"A code for {topic}:", max_tokens=20, temperature=1.0, seed=i,
            extra_body={"guided_regex": pattern})
        return (picked.choices[0].message.content, coded.choices[0].message.content,
                completed.choices[0].text)

    for picked, coded, completed in run_all(one, num_prompts(backend)):
        assert picked in choices
        assert re.fullmatch(pattern, coded) and re.fullmatch(pattern, completed)


def test_streamed_tool_calls_accumulate_to_the_reply(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ask("the weather in Oslo"), tools=TOOLS,
                                  tool_choice="required", max_tokens=200, temperature=0.0,
                                  parallel_tool_calls=False)
    reply = client.chat.completions.create(**kwargs)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for fragment in choice.delta.tool_calls or []:
                call = calls.setdefault(fragment.index, {"id": None, "name": None, "arguments": ""})
                if fragment.id:
                    assert call["id"] is None and fragment.function.name  # header first, once
                    call["id"], call["name"] = fragment.id, fragment.function.name
                call["arguments"] += fragment.function.arguments or ""
    expected = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert finish == "tool_calls"
    # The SDK's own accumulator agrees.
    with client.beta.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments)
            for c in final.choices[0].message.tool_calls] == expected


def test_a_tool_result_in_the_history(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ask("the weather in Oslo"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=200,
        temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    history = ask("the weather in Oslo") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=30, temperature=0.0)
    assert second.choices[0].message.content
    assert not second.choices[0].message.tool_calls


class Person(BaseModel):
    name: Annotated[str, Field(max_length=16)]
    mood: Literal["happy", "sad", "calm"]
    age: int


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=100, temperature=0.0)
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_a_langchain_tool_round_trip(cluster: Cluster) -> None:
    import langchain_openai  # in the test extra: a broken install fails here, never skips
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_temperature(city: str) -> str:
        """The current temperature in a city, in degrees Celsius."""
        return json.dumps({"city": city, "celsius": 21})

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{cluster.gateway_url}/v1",
                                       api_key="none", temperature=0.0, max_tokens=60,
                                       max_retries=0, timeout=300)
    messages: list[Any] = [HumanMessage("How warm is it in Oslo?")]
    asked = chat.bind_tools([get_temperature], tool_choice="required",
                            parallel_tool_calls=False).invoke(messages)
    assert [call["name"] for call in asked.tool_calls] == ["get_temperature"]
    assert isinstance(asked.tool_calls[0]["args"]["city"], str)
    messages += [asked, ToolMessage(get_temperature.invoke(asked.tool_calls[0]["args"]),
                                    tool_call_id=asked.tool_calls[0]["id"])]
    answer = chat.bind_tools([get_temperature]).invoke(messages)
    assert answer.content or answer.tool_calls  # "auto": the model may answer or call again
