"""The one-call decoder layer (kernels/cpu_decode_layer.py, csrc/decode_layer.c): a decode step's
layer in one C call is bit for bit the fused path's per-op kernels, and only the layers it
computes take it (models/decode_layer.py)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from llmplatform.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.kernels import cpu_decode_layer
from llmplatform.kernels.metadata import AttentionMetadata
from llmplatform.kernels.ops import RowImpl
from llmplatform.models import llama
from llmplatform.sampling.params import SamplingParams
from tests.kernels.conftest import require_cpu_kernel


@pytest.fixture(autouse=True)
def _kernels(monkeypatch) -> None:
    require_cpu_kernel(cpu_decode_layer.kernel)
    monkeypatch.delenv("LLMPLATFORM_ATTENTION_BACKEND", raising=False)


def make(model_dir, dtype: str = "bfloat16", lora: LoRAConfig = LoRAConfig()) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype=dtype, decode_path="fused"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256), lora=lora))


def run(engine: LLMEngine, *, per_op: bool, layer_rows: list[int] | None = None) -> dict:
    """Greedy outputs with logprobs of five requests of different lengths (decode steps of 5, then
    fewer rows as they finish), every chunk as recorded; ``per_op``: without the one-call layer."""
    model = engine.runner.model.model
    model.c_layer_rows = -1 if per_op else engine.runner.ops.small_rows
    out: dict[str, list] = {}
    for i in range(5):
        prompt = [(7 * i + 13 * j) % 500 + 3 for j in range(20 + 9 * i)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True,
                                                          logprobs=3))
    real = llama.decode_layer_cpu

    def counting(weights, step, *args):
        if layer_rows is not None:
            layer_rows.append(step.rows)
        return real(weights, step, *args)

    llama.decode_layer_cpu = counting
    try:
        while engine.has_unfinished():
            for update in engine.step():
                record = asdict(update.chunk)
                record.pop("first_scheduled_time")
                out.setdefault(update.request_id, []).append(record)
    finally:
        llama.decode_layer_cpu = real
    return out


@pytest.mark.parametrize("fixture, dtype", [("tiny_model_dir", "bfloat16"), ("tiny_model_dir", "float32"),
                                            ("tiny_mistral_swa_dir", "bfloat16"), ("default_model_dir", "bfloat16")])
def test_the_one_call_layer_is_bit_for_bit_the_per_op_path(fixture, dtype, request) -> None:
    """Tokens and every logprob equal exactly (not approximately): the same kernels in the same
    order; the sliding-window model's windows reach into its cache (prompts longer than them)."""
    engine = make(request.getfixturevalue(fixture), dtype)
    layers = engine.runner.model.model.layers
    assert all(layer.c_layer is not None for layer in layers)
    rows: list[int] = []
    one_call = run(engine, per_op=False, layer_rows=rows)
    assert set(rows) == {1, 2, 3, 4, 5} and len(rows) % len(layers) == 0  # every layer, every decode step
    assert run(engine, per_op=True) == one_call


def test_layers_it_does_not_compute_keep_the_per_op_path(tiny_qwen3_dir, tiny_mixtral_dir, tiny_model_dir) -> None:
    qwen3 = make(tiny_qwen3_dir)  # q/k norms before rotary
    assert qwen3.runner.ops.layer is RowImpl.C
    assert all(layer.c_layer is None for layer in qwen3.runner.model.model.layers)
    mixtral = make(tiny_mixtral_dir)  # experts, not the dense MLP
    assert all(layer.c_layer is None for layer in mixtral.runner.model.model.layers)
    eager = LLMEngine(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="bfloat16", decode_path="eager"),
        cache=CacheConfig(kv_cache_memory_bytes=8 << 20), scheduler=SchedulerConfig(max_model_len=64)))
    assert eager.runner.ops.layer is RowImpl.TORCH
    assert all(layer.c_layer is None for layer in eager.runner.model.model.layers)


def test_adapters_take_the_layers_back(tiny_model_dir) -> None:
    """With LoRA slots on the projections (an adapter's product is not in the one call), every
    decode step runs the per-op layers."""
    engine = make(tiny_model_dir, lora=LoRAConfig(enabled=True, max_loras=1, max_lora_rank=8))
    assert all(layer.c_layer is None for layer in engine.runner.model.model.layers)
    rows: list[int] = []
    run(engine, per_op=False, layer_rows=rows)
    assert rows == []


def test_steps_of_several_rows_a_sequence_become_one_query_a_row(tiny_model_dir) -> None:
    """A step with several new rows of a sequence (verification, a short prefill) is described
    as one-token queries, each over the cache up to its own position; a cache the attention
    kernel does not take, or another dtype, is refused (None: the per-op path runs)."""
    engine = make(tiny_model_dir)
    weights = engine.runner.model.model.layers[0].c_layer
    k_cache, v_cache = engine.runner.kv_caches[0]
    head_dim = weights.head_dim

    def metadata(query_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build(context_lens=[5] * len(query_lens), query_lens=query_lens,
                                       block_tables=[[i] for i in range(len(query_lens))], block_size=16,
                                       device="cpu")

    def rope(rows: int) -> torch.Tensor:
        return torch.zeros(rows, 1, head_dim, dtype=torch.bfloat16)

    decode = cpu_decode_layer.describe_step(metadata([1, 1]), rope(2), rope(2), k_cache, v_cache, weights)
    assert decode is not None and decode.rows == 2 and decode.keep == ()  # the step's own tensors
    mixed = cpu_decode_layer.describe_step(metadata([2, 1]), rope(3), rope(3), k_cache, v_cache, weights)
    tables, lens = mixed.keep
    assert mixed.rows == 3 and lens.tolist() == [6, 7, 6] and tables[:, 0].tolist() == [0, 0, 1]
    assert (mixed.block_tables, mixed.seq_lens) == (tables.data_ptr(), lens.data_ptr())
    assert cpu_decode_layer.describe_step(metadata([1, 1]), rope(2).float(), rope(2).float(), k_cache, v_cache,
                                          weights) is None
    assert cpu_decode_layer.describe_step(metadata([1, 1]), rope(2), rope(2), k_cache.float(), v_cache.float(),
                                          weights) is None


def test_short_prefill_chunks_run_in_it_as_causal_attention(tiny_model_dir) -> None:
    """Prefill chunks of at most 16 tokens (a step budget of 16: the later chunks over a cached
    context) run in the one-call layer, as would a verification step: greedy output equals the
    per-op path's (whose multi-row steps run torch's causal attention) token for token, logprobs
    to float32 rounding. (Verification steps: tests/engine/test_speculative_*.py, whose greedy
    identity with the plain engine runs through this layer on the default fused path.)"""
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="float32", decode_path="fused"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)))
    model = engine.runner.model.model

    def outputs(per_op: bool, steps: list | None = None) -> dict:
        model.c_layer_rows = -1 if per_op else engine.runner.ops.small_rows
        real = llama.decode_layer_cpu
        llama.decode_layer_cpu = lambda w, step, *a: steps.append(step.keep != ()) or real(w, step, *a)
        try:
            out: dict[str, list] = {}
            for i in range(3):
                prompt = [(5 * i + 7 * j) % 300 + 2 for j in range(12 + 8 * i)]  # 12-28 tokens
                engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                  logprobs=2))
            while engine.has_unfinished():
                for update in engine.step():
                    out.setdefault(update.request_id, []).append(update.chunk)
            return out
        finally:
            llama.decode_layer_cpu = real

    multi_row: list[bool] = []
    one_call = outputs(False, multi_row)
    per_op = outputs(True)
    assert any(multi_row)  # the prefill chunks ran in the one call
    for rid in per_op:
        assert [c.token_ids for c in one_call[rid]] == [c.token_ids for c in per_op[rid]]
        got = [entry.logprob for c in one_call[rid] for entry in c.logprobs or ()]
        want = [entry.logprob for c in per_op[rid] for entry in c.logprobs or ()]
        assert got == pytest.approx(want, abs=1e-4)


def test_the_library_is_rebuilt_when_a_kernel_it_includes_changes(tmp_path, monkeypatch) -> None:
    """decode_layer.c includes the other kernels' sources: a change to any of them gives its
    library another cache key (else an edited kernel would keep running in its old form here)."""
    from llmplatform.kernels import cbuild

    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path / "cache"))
    for name in ("outer.c", "inner.c", "leaf.c"):
        (tmp_path / name).write_text({"outer.c": '#include "inner.c"\n', "inner.c": '#include "leaf.c"\n',
                                      "leaf.c": "int leaf(void) { return 1; }\n"}[name])
    assert cbuild.included_sources(tmp_path / "outer.c") == [tmp_path / "inner.c", tmp_path / "leaf.c"]
    before = cbuild.library_path(tmp_path / "outer.c", "cc")
    (tmp_path / "leaf.c").write_text("int leaf(void) { return 2; }\n")
    assert cbuild.library_path(tmp_path / "outer.c", "cc") != before
    assert set(cbuild.included_sources(cbuild.CSRC / "decode_layer.c")) == {
        cbuild.CSRC / name for name in ("small_linear.c", "rms_norm.c", "rotary_store.c", "silu_mul.c",
                                        "paged_decode_attention.c")}
