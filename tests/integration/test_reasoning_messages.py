"""A reasoning model's thoughts on Anthropic's Messages API, end to end: the official ``anthropic``
client against a real controller, gateway and worker (``--reasoning-parser qwen3``), compared with
what the chat route answers for the same conversation (both are the one chat path).

The model and cluster are test_reasoning_served's (a tiny random Llama whose tokenizer has
``<think>`` and ``</think>``, a template that opens the thoughts in the prompt), with one change.
A random model never ends its thoughts by itself; chat's stand-in for a thinking model is seeded
sampling with a ``logit_bias`` on ``</think>``, but a Messages request has neither a seed nor a
logit bias (the gateway ignores fields Anthropic's API lacks). So this module serves a variant
whose weights do what the bias did, under greedy decoding: the ``</think>`` row of the
(tied) output embedding gets a component along the hidden state of one early step, chosen so that
``</think>`` wins that step by a clear margin and loses every earlier one (the steps before it
do not see the row, so they are unchanged). :func:`model_dir` searches the steps and checks with
a greedy generation that the model then writes a few thoughts, ``</think>`` once, and an answer.
What it writes is random; what is checked is how the gateway shows it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.integration.cluster import Cluster
# test_reasoning_served's fixtures, used as they are: `cluster` serves this module's `model_dir`
# (the variant below), built from that module's `model_dir`, imported here as `thinker_dir`.
from tests.integration.test_reasoning_served import MESSAGES, MODEL, cluster  # noqa: F401
from tests.integration.test_reasoning_served import model_dir as thinker_dir  # noqa: F401

MAX_TOKENS = 24
EARLIEST_END, LATEST_END = 3, 9  # the step (output token) at which the thoughts end
MARGIN = 2.0  # logits: how clearly </think> wins its step and loses the ones before


def _greedy_steps(model: Any, ids: Any, steps: int, banned: int) -> list[tuple[Any, float]]:
    """Greedy decoding with token `banned` never picked: at each step, the output layer's input
    and the best logit of the other tokens."""
    import torch

    seen: list[Any] = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0, -1].clone()))
    best = []
    try:
        with torch.no_grad():
            for _ in range(steps):
                logits = model(ids).logits[0, -1]
                logits[banned] = float("-inf")
                best.append(float(logits.max()))
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    finally:
        hook.remove()
    return list(zip(seen, best))


@pytest.fixture(scope="module")
def model_dir(thinker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    import torch
    from transformers import LlamaForCausalLM

    from llmplatform.llm.resolve import load_tokenizer

    out = tmp_path_factory.mktemp("tiny-thinker-greedy")
    shutil.copytree(thinker_dir, out, dirs_exist_ok=True)
    tokenizer = load_tokenizer(out)
    model = LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                           chat_template=(out / "thinking.jinja").read_text())
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    end = tokenizer.convert_tokens_to_ids("</think>")
    row = model.lm_head.weight.detach()[end]  # a view: the tied embedding's row too
    steps = _greedy_steps(model, ids, LATEST_END + 1, end)
    for step in range(EARLIEST_END, LATEST_END + 1):
        h, best = steps[step]
        scale = (best - float(h @ row) + MARGIN) / float(h @ h)  # </think> wins by MARGIN here
        if any(float(x @ row) + scale * float(h @ x) > other - MARGIN for x, other in steps[:step]):
            continue  # ... but it would win (or nearly) an earlier step too
        row += scale * h
        written = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:]
        written = written.tolist()
        if written.count(end) == 1 and written.index(end) == step and len(written) > step + 3:
            model.save_pretrained(str(out), safe_serialization=True)
            return out
        row -= scale * h
    raise RuntimeError("no early step lets </think> win clearly: the stand-in cannot be built")


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> anthropic.Anthropic:  # noqa: F811
    return anthropic.Anthropic(base_url=cluster.gateway_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat(cluster: Cluster) -> openai.OpenAI:  # noqa: F811
    return cluster.openai_client(timeout_s=300)


GREEDY = {"extra_body": {"temperature": 0.0}}  # not a parameter of this client's create()
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _blocks(message: Any) -> list[dict[str, Any]]:
    return [block.model_dump() for block in message.content]


def test_thinking_block_and_text_equal_chats_reasoning_and_content(client, chat) -> None:
    expected = chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            temperature=0)
    said = expected.choices[0].message
    thoughts, answer = said.model_extra.get("reasoning_content"), said.content
    assert thoughts and answer  # the stand-in thought, then answered
    message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES, **GREEDY)
    assert _blocks(message) == [{"type": "thinking", "thinking": thoughts, "signature": ""},
                                {"type": "text", "text": answer, "citations": None}]
    assert message.stop_reason == STOP_REASONS[expected.choices[0].finish_reason]
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens

    # Thinking asked for in each way that leaves the model its default: the same message.
    for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": MAX_TOKENS}):
        again = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES,
                                       thinking=thinking, **GREEDY)
        assert _blocks(again) == _blocks(message), thinking


def test_the_stream_adds_up_to_the_message(client) -> None:
    message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES, **GREEDY)
    kinds, thinking, text, signatures = [], [], [], []
    with client.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES,
                                **GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_start":
                kinds.append(event.content_block.model_dump())
            elif event.type == "thinking":
                thinking.append(event.thinking)
            elif event.type == "text":
                text.append(event.text)
            elif event.type == "signature":
                signatures.append(event.signature)
        final = stream.get_final_message()
    assert kinds == [{"type": "thinking", "thinking": "", "signature": ""},
                     {"type": "text", "text": "", "citations": None}]
    assert len(thinking) > 1  # the thoughts came in pieces, as generated
    assert "".join(thinking) == message.content[0].thinking
    assert "".join(text) == message.content[1].text
    assert signatures == [""]
    assert _blocks(final) == _blocks(message)
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_thinking_disabled_is_all_answer(client, chat) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    expected = chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            extra_body=off, temperature=0)
    message = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES,
                                     thinking={"type": "disabled"}, **GREEDY)
    assert _blocks(message) == [{"type": "text", "text": expected.choices[0].message.content,
                                 "citations": None}]
    # The template wrote the empty thoughts block into the prompt: chat's prompt, not the default.
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    default = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES, **GREEDY)
    assert message.usage.input_tokens != default.usage.input_tokens
    # count_tokens renders the prompt with the same switch.
    assert client.messages.count_tokens(model=MODEL, messages=MESSAGES, thinking={
        "type": "disabled"}).input_tokens == message.usage.input_tokens
    assert (client.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens
            == default.usage.input_tokens)
    with client.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES,
                                thinking={"type": "disabled"}, **GREEDY) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(message)


def test_thinking_blocks_sent_back_are_dropped_from_the_context(client, chat) -> None:
    first = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=MESSAGES, **GREEDY)
    assert first.content[0].type == "thinking"
    follow_up = {"role": "user", "content": "And three plus three?"}
    sent_back = [*MESSAGES, {"role": "assistant", "content": _blocks(first)}, follow_up]
    answer_only = [*MESSAGES, {"role": "assistant", "content": first.content[1].text}, follow_up]
    message = client.messages.create(model=MODEL, max_tokens=4, messages=sent_back, **GREEDY)
    expected = chat.chat.completions.create(model=MODEL, messages=answer_only, max_tokens=4,
                                            temperature=0)
    assert message.usage.input_tokens == expected.usage.prompt_tokens


def test_a_thinking_budget_is_refused_in_anthropics_envelope(client) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=2048, messages=MESSAGES,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert caught.value.status_code == 400
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "'thinking.budget_tokens'" in error["error"]["message"]
    assert "at least max_tokens (2048)" in error["error"]["message"]
