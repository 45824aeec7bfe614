"""Tiny random "thinking" models for the reasoning tests, and their cluster.

The tokenizer is the default model's with ``<think>`` and ``</think>`` added as single tokens
(as in Qwen3's vocabulary); the chat template is the shipped Hermes one whose generation prompt
opens the thoughts block (``<think>\\n``), or writes an empty one when ``enable_thinking`` is
false, as Qwen3's does. The worker reads the output with ``--reasoning-parser qwen3``.

A random model never ends its thoughts by itself. Two stand-ins for a thinking model:

- :func:`save_thinker`: random weights; a request makes it end its thoughts with seeded sampling
  and a ``logit_bias`` on ``</think>`` (what chat and completions can ask for).
- :func:`save_steered_thinker`: weights edited so that greedy decoding of :data:`MESSAGES` writes
  a few thoughts, ``</think>``, a few answer tokens and then stops. For dialects that have
  neither ``seed`` nor ``logit_bias`` (Responses, Messages): greedy decoding needs neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmplatform.llm.base import LLMBackend
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.templates import __file__ as _templates_init
from tests.conftest import TINY_LLAMA
from tests.integration.cluster import Cluster, running_cluster

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
TEMPLATE = "thinking.jinja"
NUM_THOUGHT_TOKENS = 6
"""Tokens the steered model thinks (greedy, on MESSAGES) before ``</think>``."""
NUM_ANSWER_TOKENS = 5
"""Tokens it answers after ``</think>`` before its end-of-turn token."""
_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' -}}"
_THINKING_PROMPT = (
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}")
_STEER_MARGIN = 5.0
"""How far (in logits) a steered token leads the best other token at its step."""
_MIN_MARGIN = 0.05
"""The least lead of the greedy token at any step of the steered reply."""
_MAX_SEEDS = 16


def save_thinker(out: Path, default_model_dir: Path) -> Path:
    """The random thinker (tied embeddings, seed 0) in `out`."""
    tokenizer = _save_tokenizer_and_template(out, default_model_dir)
    _new_model(tokenizer, tie_word_embeddings=True).save_pretrained(str(out), safe_serialization=True)
    return out


def save_steered_thinker(out: Path, default_model_dir: Path) -> Path:
    """The steered thinker in `out`: its greedy reply to MESSAGES is NUM_THOUGHT_TOKENS
    thoughts, ``</think>``, NUM_ANSWER_TOKENS answer tokens, end of turn (:func:`_steer`). The
    random weights are those of the first seed whose reply has no near tie at any step (so
    that the engine's arithmetic, not bit-identical to transformers', picks the same tokens)."""
    tokenizer = _save_tokenizer_and_template(out, default_model_dir)
    prompt_ids = tokenizer(chat_prompt(tokenizer, out), add_special_tokens=False).input_ids
    end_of_thoughts = tokenizer.convert_tokens_to_ids("</think>")
    for seed in range(_MAX_SEEDS):
        model = _new_model(tokenizer, tie_word_embeddings=False, seed=seed).eval()
        reply, margin = _steer(model, prompt_ids, end_of_thoughts)
        if margin > _MIN_MARGIN:
            break
    else:
        raise AssertionError(f"no seed below {_MAX_SEEDS} steers without a near tie")
    assert reply.count(end_of_thoughts) == 1 and tokenizer.decode(
        reply[NUM_THOUGHT_TOKENS + 1:-1]).strip(), "the answer must be some text"
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _steer(model: Any, prompt_ids: list[int], end_of_thoughts: int) -> tuple[list[int], float]:
    """Edit `model` so that its greedy reply to `prompt_ids` is NUM_THOUGHT_TOKENS tokens,
    `end_of_thoughts`, NUM_ANSWER_TOKENS tokens, end of turn; returns that reply and the least
    lead of the chosen token over the next best at any of its steps.

    Only two rows of the output projection are written (the embeddings are untied, so the
    prompt reads the same): those of ``</think>`` and of the end-of-turn token. Each is the part
    of the final hidden state at the step where it must be chosen that is orthogonal to the
    hidden states of every earlier step of the reply, scaled to lead that step by
    :data:`_STEER_MARGIN`; at the earlier steps its logit is 0, below the best token's."""
    import torch

    end_of_turn = model.config.eos_token_id
    head = model.lm_head.weight  # [vocab, hidden]
    ids, states = list(prompt_ids), []  # the reply so far; each step's final hidden state

    def step() -> tuple[Any, Any]:
        state = model.model(torch.tensor([ids])).last_hidden_state[0, -1]  # [hidden]
        return state, model.lm_head(state)  # [vocab]

    def greedy(num_tokens: int) -> None:
        for _ in range(num_tokens):
            state, logits = step()
            states.append(state)
            ids.append(int(logits.argmax()))

    def steer(token: int) -> None:
        state, logits = step()
        basis = torch.linalg.qr(torch.stack(states, dim=1)).Q  # [hidden, len(states)]
        own = state - basis @ (basis.T @ state)
        head[token] = own * ((logits.max() + _STEER_MARGIN) / own.dot(state))
        states.append(state)
        ids.append(token)

    with torch.no_grad():
        head[end_of_thoughts] = 0.0  # neither is chosen before its step
        head[end_of_turn] = 0.0
        greedy(NUM_THOUGHT_TOKENS)
        steer(end_of_thoughts)
        greedy(NUM_ANSWER_TOKENS)
        steer(end_of_turn)
        reply = ids[len(prompt_ids):]
        logits = model(torch.tensor([ids[:-1]])).logits[0, len(prompt_ids) - 1:]  # [reply, vocab]
    top = logits.topk(2, dim=-1)
    assert top.indices[:, 0].tolist() == reply, "the steered reply is not the greedy one"
    return reply, float((top.values[:, 0] - top.values[:, 1]).min())


def _save_tokenizer_and_template(out: Path, default_model_dir: Path) -> Any:
    from llmplatform.llm.resolve import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])  # one token each, as in Qwen3's vocabulary
    tokenizer.model_max_length = TINY_LLAMA["max_position_embeddings"]
    tokenizer.save_pretrained(str(out))
    shipped = (Path(_templates_init).parent / "chatml_hermes_tools.jinja").read_text()
    assert _GENERATION_PROMPT in shipped
    (out / TEMPLATE).write_text(shipped.replace(_GENERATION_PROMPT, _THINKING_PROMPT))
    return tokenizer


def _new_model(tokenizer: Any, *, tie_word_embeddings: bool, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": tie_word_embeddings},
                         vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def chat_prompt(tokenizer: Any, model_dir: Path, messages: list[dict[str, Any]] = MESSAGES,
                **kwargs: Any) -> str:
    """`messages` as the worker renders them (`kwargs`: template variables)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=(model_dir / TEMPLATE).read_text(), **kwargs)


def thinker_backend(model_dir: Path, name: str = MODEL, reasoning_parser: str = "qwen3") -> LLMBackend:
    """The thinker in `model_dir` on the paged backend (CPU, float32), with hermes tools."""
    return build_backend(BackendConfig(
        model_path=str(model_dir), model_names=(name,), backend="paged", device="cpu",
        dtype="float32", kv_cache_memory="64MiB", chat_template=str(model_dir / TEMPLATE),
        tool_call_parser="hermes", reasoning_parser=reasoning_parser))


@contextlib.contextmanager
def thinker_cluster(model_dir: Path, **gateway: Any) -> Iterator[Cluster]:
    """A controller, a gateway (`gateway`: its settings) and one worker serving the thinker in
    `model_dir` as :data:`MODEL`, read with the qwen3 reasoning parser."""
    with running_cluster(**gateway) as cluster:
        cluster.add_worker(thinker_backend(model_dir))
        yield cluster
