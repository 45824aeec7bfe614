"""The decode-path seam (engine/decode_path.py): which path a config gets, the loud fallback, and
that the fused path really runs decode steps on the C kernels (parity: tests/engine/test_engine.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.decode_path import apply_decode_path
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.kernels import cpu_linear
from llmplatform.kernels.cbuild import KernelUnavailableError
from llmplatform.models import llama
from llmplatform.models.llama import LlamaForCausalLM
from llmplatform.sampling.params import SamplingParams


def small_model() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    return LlamaForCausalLM(config, dtype=torch.float32)


def test_eager_leaves_the_model_alone() -> None:
    model = small_model()
    assert apply_decode_path("eager", model, torch.device("cpu")) == "eager"
    assert model.model.layers[0].self_attn.fused_max_rows == 0
    assert model.model.layers[0].self_attn.qkv_proj._row_kernel is None


def test_auto_is_fused_on_cpu_when_the_kernels_build() -> None:
    if not cpu_linear.available():
        pytest.skip("no C compiler here")
    model = small_model()
    assert apply_decode_path("auto", model, torch.device("cpu")) == "fused"
    assert model.model.layers[1].mlp.down_proj._row_kernel is not None


def test_without_the_kernels_auto_falls_back_loudly_and_fused_refuses(monkeypatch, caplog) -> None:
    def unavailable():
        raise KernelUnavailableError("no C compiler found (install gcc or set CC)")

    monkeypatch.setattr(cpu_linear, "kernel", unavailable)
    with caplog.at_level(logging.WARNING, logger="llmplatform.engine"):
        assert apply_decode_path("auto", small_model(), torch.device("cpu")) == "eager"
    assert any("eager" in r.getMessage() and "no C compiler" in r.getMessage() for r in caplog.records)
    with pytest.raises(KernelUnavailableError):
        apply_decode_path("fused", small_model(), torch.device("cpu"))


def test_fused_is_cpu_only_and_unknown_paths_are_refused() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        apply_decode_path("fused", small_model(), torch.device("cuda"))
    assert apply_decode_path("auto", small_model(), torch.device("cuda")) == "eager"
    with pytest.raises(ValueError, match="decode_path"):
        ModelConfig("m", ("m",), decode_path="compiled")


def test_fused_decode_steps_run_on_the_kernels(tiny_model_dir, monkeypatch) -> None:
    if not cpu_linear.available():
        pytest.skip("no C compiler here")
    fused_calls = []
    real = llama.fused_decode_attention

    def counting(qkv, *args):
        out = real(qkv, *args)
        fused_calls.append((qkv.shape[0], out is not None))
        return out

    monkeypatch.setattr(llama, "fused_decode_attention", counting)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="bfloat16", decode_path="fused"),
        cache=CacheConfig(num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128)))
    for i in range(3):
        engine.add_request(str(i), list(range(10 + i, 40)), SamplingParams(temperature=0, max_tokens=5,
                                                                           ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    num_layers = engine.runner.model.num_layers
    # the prefill step (90 tokens) never reaches it; each decode step's layers all take it
    assert all(rows == 3 and took for rows, took in fused_calls)
    assert len(fused_calls) == 4 * num_layers  # 4 decode steps after the one that prefilled
