"""A reasoning model served end to end: a worker with ``--reasoning-parser qwen3`` behind a real
controller and gateway, driven with the official openai client.

The model is a tiny random Llama whose tokenizer (the default model's) has ``<think>`` and
``</think>`` as single tokens, as Qwen3's has, and whose chat template opens the thoughts block
in the prompt (or writes an empty one when ``enable_thinking`` is false): see
tests/integration/thinking_model.py. A random model never ends its thoughts by itself; the
stand-in for a thinking model is seeded sampling with a ``logit_bias`` on ``</think>``, so that
it ends them after a few tokens. What it writes is random; what is checked is how it is split,
against the raw text the completions endpoint returns for the same prompt and seed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration.cluster import Cluster
from tests.integration.thinking_model import (
    MESSAGES,
    MODEL,
    chat_prompt,
    save_thinker,
    thinker_cluster,
)

SAMPLING = dict(temperature=1.0, seed=7, max_tokens=40)
SEEDS = range(4)
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}},
    "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return save_thinker(tmp_path_factory.mktemp("tiny-thinker"), default_model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from llmplatform.llm.resolve import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    with thinker_cluster(model_dir) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client(timeout_s=300)


def _prompt(tokenizer: Any, model_dir: Path, **kwargs: Any) -> str:
    return chat_prompt(tokenizer, model_dir, **kwargs)


def _end_bias(tokenizer: Any, bias: float = 9.0) -> dict[str, float]:
    return {str(tokenizer.convert_tokens_to_ids("</think>")): bias}


def test_thoughts_and_answer_split_streamed_and_not(client: openai.OpenAI, tokenizer: Any,
                                                    model_dir: Path) -> None:
    bias = _end_bias(tokenizer)
    raw = client.completions.create(model=MODEL, prompt=_prompt(tokenizer, model_dir),
                                    logit_bias=bias, **SAMPLING).choices[0].text
    assert "</think>" in raw  # the completions endpoint is not split
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias=bias,
                                           **SAMPLING)
    message = reply.choices[0].message
    thoughts, answer = raw.split("</think>", 1)
    answer = answer.lstrip()  # the blank between thoughts and answer is dropped
    assert thoughts and answer, raw
    assert message.reasoning_content == thoughts
    assert message.model_extra["reasoning"] == thoughts  # newer vLLM's name
    assert message.content == answer

    reasoning, content, finish = [], [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias=bias,
                                                stream=True, **SAMPLING):
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(choice.delta.content or "")
            assert "reasoning_content" not in delta or choice.delta.content is None
            finish = choice.finish_reason or finish
    assert "".join(reasoning) == thoughts
    assert "".join(content) == answer
    assert finish == reply.choices[0].finish_reason


def test_enable_thinking_false_reaches_the_template(client: openai.OpenAI, tokenizer: Any,
                                                     model_dir: Path) -> None:
    off = _prompt(tokenizer, model_dir, enable_thinking=False)
    assert off != _prompt(tokenizer, model_dir)
    raw = client.completions.create(model=MODEL, prompt=off, **SAMPLING).choices[0].text
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **SAMPLING)
    assert reply.usage.prompt_tokens == len(tokenizer(off, add_special_tokens=False).input_ids)
    assert reply.choices[0].message.content == raw  # all answer, not thoughts
    assert reply.choices[0].message.model_extra.get("reasoning_content") is None


def test_json_schema_applies_to_the_answer_after_thoughts(client: openai.OpenAI,
                                                           tokenizer: Any) -> None:
    def one(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logit_bias=_end_bias(tokenizer), temperature=1.0,
            seed=seed, max_tokens=120, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})

    thoughts = []
    for reply in _concurrently(one, SEEDS):  # one batch on the engine
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
        thoughts.append(choice.message.model_extra.get("reasoning_content"))
    # The thoughts were free text (the grammar left them alone), then ended.
    assert any(thoughts), thoughts


def test_a_forced_tool_call_after_thoughts(client: openai.OpenAI, tokenizer: Any) -> None:
    # One call: with parallel calls allowed a random model may write call after call (and the
    # JSON grammar lets it pad each with whitespace) until max_tokens, ~1 request in 4 at 120.
    def one(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logit_bias=_end_bias(tokenizer), temperature=1.0,
            seed=seed, max_tokens=160, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)

    thoughts = []
    for reply in _concurrently(one, SEEDS):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        thoughts.append(choice.message.model_extra.get("reasoning_content"))
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert any(thoughts), thoughts


def _concurrently(fn: Any, args: range) -> list[Any]:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_is_never_content(client: openai.OpenAI,
                                                         stream: bool) -> None:
    """Issue 39 item 5: the grammar makes the model write a call; each max_tokens cuts it at
    another place, inside the tag, the name or the arguments."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for max_tokens in range(1, 9):
        if stream:
            content, names, finish = "", [], None
            for chunk in client.chat.completions.create(max_tokens=max_tokens, stream=True,
                                                        **kwargs):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    names += [c.function.name for c in choice.delta.tool_calls or []
                              if c.function and c.function.name]
                    finish = choice.finish_reason or finish
        else:
            choice = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            names = [c.function.name for c in choice.message.tool_calls or []]
        assert finish == "length", max_tokens
        assert content == "", (max_tokens, content)
        assert names in ([], ["get_weather"]), (max_tokens, names)
