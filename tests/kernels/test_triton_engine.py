"""The engine on the Triton kernels: greedy output of the tiny model equals the torch backend's.

On CPU the kernels run interpreted (slow), so the workload is small: four prompts of 3 to 45
tokens, 6 new tokens each, a 16-token step budget that chunks the longer prompts (chunked prefill
over a cached prefix, mixed prefill + decode steps) and decode-only steps at the end. On CUDA
(``gpu``) the same comparison runs the compiled kernels.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import triton  # noqa: E402,F401  (the test extra installs it: a broken install must fail, not skip)

import llmplatform.kernels as kernels  # noqa: E402
from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from llmplatform.engine.llm_engine import LLMEngine  # noqa: E402
from llmplatform.kernels import BACKEND_ENV_VAR  # noqa: E402
from llmplatform.sampling.params import SamplingParams  # noqa: E402

NEW_TOKENS = 6


def make_engine(model_dir, device: torch.device) -> LLMEngine:
    return LLMEngine(EngineConfig(
        # Eager: this test counts the kernels' Python launches, which a replayed CUDA graph skips
        # (graphs: test_cuda_graphs_engine.py).
        model=ModelConfig(str(model_dir), ("m",), device=device.type, dtype="float32", enforce_eager=True),
        cache=CacheConfig(block_size=16, num_blocks=24),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)))


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            tokens[update.request_id].extend(update.chunk.token_ids)
    assert not engine.has_unfinished()
    return [tokens[str(i)] for i in range(len(prompts))]


def test_greedy_output_on_triton_equals_torch(tiny_model_dir, triton_device: torch.device,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.kernels import triton_decode_attention, triton_prefill_attention, triton_store_kv

    engine = make_engine(tiny_model_dir, triton_device)
    words = "the quick brown fox jumps over the lazy dog while one two three rivers run".split()
    prompts = [engine.tokenizer(" ".join(words[:n] * reps))["input_ids"] for n, reps in
               ((3, 1), (14, 1), (9, 3), (16, 3))]
    assert 32 < max(len(p) for p in prompts) <= 64 - NEW_TOKENS  # three chunks of a 16-token budget

    calls: Counter[str] = Counter()

    def counting(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counting(triton_store_kv, "store_kv_cache_triton")
    counting(triton_decode_attention, "paged_decode_attention_triton")
    counting(triton_prefill_attention, "paged_prefill_attention_triton")

    on_triton = greedy_tokens(engine, prompts)  # triton_device set LLMPLATFORM_ATTENTION_BACKEND=triton
    num_layers = 2
    assert calls["paged_decode_attention_triton"] >= num_layers  # decode-only steps ran...
    assert calls["paged_prefill_attention_triton"] >= num_layers  # ...and prefill / mixed steps
    assert calls["store_kv_cache_triton"] == calls["paged_decode_attention_triton"] + calls[
        "paged_prefill_attention_triton"]

    assert engine.runner.ops.attention is kernels.AttentionBackend.TRITON
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    on_torch_engine = make_engine(tiny_model_dir, triton_device)
    assert on_torch_engine.runner.ops.attention is kernels.AttentionBackend.TORCH
    on_torch = greedy_tokens(on_torch_engine, prompts)
    assert on_triton == on_torch
    assert all(len(tokens) == NEW_TOKENS for tokens in on_triton)


def test_sliding_window_model_on_triton_equals_transformers(tiny_mistral_swa_dir, triton_device: torch.device) -> None:
    """The tiny Mistral whose layers attend to their last 16 positions, blocks of 4: prompts of
    ~20 to ~45 tokens chunked by a 16-token budget and decoded past the window, so the engine
    frees blocks the Triton kernels must then skip; greedy tokens equal transformers'."""
    from transformers import AutoModelForCausalLM

    from tests.engine.test_engine import hf_greedy

    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(tiny_mistral_swa_dir), ("m",), device=triton_device.type, dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=48),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)))
    assert engine.runner.ops.attention is kernels.AttentionBackend.TRITON
    assert engine.block_manager.attention_window == 16
    words = "the quick brown fox jumps over the lazy dog while one two three rivers run".split()
    prompts = [engine.tokenizer(" ".join(words[:n] * reps))["input_ids"] for n, reps in ((14, 1), (9, 4))]
    freed = Counter()
    real_free = engine.block_manager.free_out_of_window

    def counting(seq):
        freed["blocks"] += (n := real_free(seq))
        return n

    engine.block_manager.free_out_of_window = counting
    got = greedy_tokens(engine, prompts)
    assert freed["blocks"] > 0
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_mistral_swa_dir, dtype=torch.float32).eval()
    assert got == [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
