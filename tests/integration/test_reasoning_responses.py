"""A reasoning model's thoughts through OpenAI's Responses API, end to end: a worker with
``--reasoning-parser qwen3`` behind a real controller and gateway (responses stored in a SQLite
file), driven with the official openai client's ``responses`` calls.

The Responses API has neither ``seed`` nor ``logit_bias`` (and the gateway does not invent them
for it), so the seeded, biased sampling that makes test_reasoning_served.py's random model end
its thoughts cannot be asked for here. The stand-in is instead a model whose weights make greedy
decoding think a few tokens, write ``</think>``, answer a few tokens and stop
(thinking_model.save_steered_thinker): ``temperature: 0`` is all a request needs, in every
dialect. What it writes is still random text; what is checked is that the Responses items carry
exactly what chat's ``reasoning_content`` and ``content`` carry for the same conversation. A
second worker serves the same model read with ``deepseek_r1`` (a model that always thinks), where
``reasoning.effort: "none"`` cannot be honoured.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.cluster import Cluster
from tests.integration.thinking_model import (
    MESSAGES,
    MODEL,
    NUM_ANSWER_TOKENS,
    NUM_THOUGHT_TOKENS,
    chat_prompt,
    save_steered_thinker,
    thinker_backend,
    thinker_cluster,
)

ALWAYS_THINKS = "r1"
"""The same model read with the deepseek_r1 parser: a syntax without a switch to turn thinking off."""
GREEDY = dict(model=MODEL, temperature=0.0)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return save_steered_thinker(tmp_path_factory.mktemp("steered-thinker"), default_model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from llmplatform.llm.resolve import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with thinker_cluster(model_dir, responses_store=str(store)) as cluster:
        cluster.add_worker(thinker_backend(model_dir, ALWAYS_THINKS, "deepseek_r1"))
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client(timeout_s=300)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(messages=messages, max_tokens=MAX_TOKENS, **GREEDY,
                                          **kwargs)


def _thoughts(response: Any) -> list[str]:
    return [part.text for item in response.output if item.type == "reasoning"
            for part in item.content]


def test_the_thoughts_are_a_reasoning_item_streamed_and_not(client: openai.OpenAI) -> None:
    chat = _chat(client, MESSAGES)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop"  # the stand-in thought, answered and stopped
    assert chat.usage.completion_tokens == NUM_THOUGHT_TOKENS + 1 + NUM_ANSWER_TOKENS + 1
    thoughts, answer = message.model_extra["reasoning_content"], message.content
    assert thoughts and answer

    response = client.responses.create(input=MESSAGES, max_output_tokens=MAX_TOKENS, **GREEDY)
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.status == "completed" and reasoning.encrypted_content is None
    assert _thoughts(response) == [thoughts]
    assert response.output_text == answer
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0  # not counted (docs)

    deltas: dict[str, list[str]] = {"reasoning": [], "text": []}
    kinds, completed = [], None
    for event in client.responses.create(input=MESSAGES, max_output_tokens=MAX_TOKENS,
                                         stream=True, **GREEDY):
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            deltas["reasoning"].append(event.delta)
        elif event.type == "response.output_text.delta":
            deltas["text"].append(event.delta)
        elif event.type == "response.reasoning_text.done":
            assert event.text == thoughts
        elif event.type == "response.output_item.added" and event.output_index == 0:
            assert event.item.type == "reasoning" and event.item.status == "in_progress"
        elif event.type == "response.completed":
            completed = event.response
    assert "".join(deltas["reasoning"]) == thoughts and "".join(deltas["text"]) == answer
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    assert [item.type for item in completed.output] == ["reasoning", "message"]
    assert _thoughts(completed) == [thoughts] and completed.output_text == answer

    # The client's stream helper builds the same response from the events.
    with client.responses.stream(input=MESSAGES, max_output_tokens=MAX_TOKENS, **GREEDY) as stream:
        final = stream.get_final_response()
    assert _thoughts(final) == [thoughts] and final.output_text == answer


def test_effort_none_turns_the_thinking_off(client: openai.OpenAI, tokenizer: Any,
                                            model_dir: Path) -> None:
    off = chat_prompt(tokenizer, model_dir, enable_thinking=False)  # the empty thoughts block
    chat = _chat(client, MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    response = client.responses.create(input=MESSAGES, max_output_tokens=MAX_TOKENS,
                                       reasoning={"effort": "none"}, **GREEDY)
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == len(tokenizer(off, add_special_tokens=False).input_ids)
    assert response.output_text == chat.choices[0].message.content
    assert response.reasoning.effort == "none"
    events = list(client.responses.create(input=MESSAGES, max_output_tokens=MAX_TOKENS,
                                          reasoning={"effort": "none"}, stream=True, **GREEDY))
    assert not [e for e in events if "reasoning" in e.type]
    assert events[-1].response.output_text == response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_an_effort_it_cannot_honour_is_a_400(client: openai.OpenAI, stream: bool) -> None:
    for reasoning, param in (({"effort": "high"}, "reasoning.effort"),
                             ({"summary": "auto"}, "reasoning.summary")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(input=MESSAGES, reasoning=reasoning, stream=stream, **GREEDY)
        assert caught.value.param == param, caught.value


@pytest.mark.parametrize("stream", [False, True])
def test_effort_none_is_refused_where_the_model_always_thinks(client: openai.OpenAI,
                                                              stream: bool) -> None:
    thinking = client.responses.create(input=MESSAGES, max_output_tokens=MAX_TOKENS,
                                       **{**GREEDY, "model": ALWAYS_THINKS})
    assert [item.type for item in thinking.output] == ["reasoning", "message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input=MESSAGES, reasoning={"effort": "none"}, stream=stream,
                                **{**GREEDY, "model": ALWAYS_THINKS})
    assert caught.value.param == "reasoning.effort" and ALWAYS_THINKS in str(caught.value)


def test_a_continuation_keeps_the_reasoning_item_and_hides_it_from_the_model(
        client: openai.OpenAI) -> None:
    first = client.responses.create(input=MESSAGES, max_output_tokens=MAX_TOKENS, **GREEDY)
    assert client.responses.retrieve(first.id).output[0].type == "reasoning"
    follow_up = {"role": "user", "content": "And three plus three?"}
    second = client.responses.create(previous_response_id=first.id, input=[follow_up],
                                     max_output_tokens=MAX_TOKENS, **GREEDY)
    # The model saw the earlier answer only, as a chat client sends it back.
    history = [*MESSAGES, {"role": "assistant", "content": first.output_text}, follow_up]
    chat = _chat(client, history)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    thoughts = chat.choices[0].message.model_extra.get("reasoning_content")
    assert _thoughts(second) == ([thoughts] if thoughts else [])
    assert second.output_text == (chat.choices[0].message.content or "")
    # A client managing the context itself sends the reasoning item back: kept, not shown.
    manual = client.responses.create(input=[*MESSAGES, *[item.model_dump(exclude_none=True)
                                                         for item in first.output], follow_up],
                                     max_output_tokens=MAX_TOKENS, store=False, **GREEDY)
    assert manual.usage.input_tokens == chat.usage.prompt_tokens
    assert manual.output_text == second.output_text
