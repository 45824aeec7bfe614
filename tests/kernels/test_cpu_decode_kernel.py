"""The CPU decode-attention C kernel (``kernels/cpu_decode.py``): numbers, engine output, build.

``test_attention_reference.py`` already runs every batch shape on the ``cpu`` backend; these add
the shapes served models have (head_dim 64 and 128 with 16-token blocks, the kernel's specialized
copies, AVX-512 ones where the CPU has it), bf16 caches, many sequences (one work item each),
long sequences whose softmax max moves across many blocks, the engine's greedy output against
the torch backend, one OpenMP runtime in the process, and what happens without a C compiler.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import llmplatform.kernels as kernels
from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.kernels import BACKEND_ENV_VAR, cpu_decode
from llmplatform.kernels.ops import plan_ops
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import run_to_completion
from tests.kernels.conftest import require_cpu_kernel


@pytest.fixture(autouse=True)
def kernel_built() -> None:
    require_cpu_kernel()


def dense_decode(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                 scale: float) -> torch.Tensor:
    """float64 reference: query [n, H, D]; keys[i], values[i] [len_i, Hkv, D]."""
    out = []
    for i, (k, v) in enumerate(zip(keys, values)):
        group = query.shape[1] // k.shape[1]
        k64 = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
        v64 = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i].double(), k64) * scale  # [H, L]
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v64))
    return torch.stack(out)


def paged_case(lens: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, query_scale: float = 1.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-length // block_size) for length in lens]
    num_blocks = sum(needed) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled tables, block 0 in use too
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    keys, values = [], []
    for i, length in enumerate(lens):
        blocks = [order.pop() for _ in range(needed[i])]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        keys.append(k_cache.view(-1, num_kv_heads, head_dim)[slots])
        values.append(v_cache.view(-1, num_kv_heads, head_dim)[slots])
    query = (torch.randn(len(lens), num_heads, head_dim, generator=gen) * query_scale).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size,num_heads,num_kv_heads", [
    (64, 16, 9, 3),  # SmolLM2-135M: the specialized 64/16 copy, 3 query heads per kv head
    (128, 16, 32, 8),  # Llama-3-8B's grouping: the 128/16 copy
    (32, 8, 4, 4),  # no grouping, the generic copy
    (80, 32, 10, 2),  # odd head size, the generic copy
    (96, 16, 16, 2),  # 8 query heads per kv head: the AVX-512 copy's largest group, 6 chunks
    (64, 16, 32, 2),  # 16 query heads per kv head: past the AVX-512 copy, the generic one
])
def test_matches_dense_attention(dtype, head_dim, block_size, num_heads, num_kv_heads) -> None:
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 300]
    query, k_cache, v_cache, tables, seq_lens, keys, values = paged_case(
        lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    scale = head_dim**-0.5
    got = cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, scale)
    assert got.shape == query.shape and got.dtype == dtype
    expected = dense_decode(query, keys, values, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 32, 8)])
def test_many_sequences_one_item_each(dtype, head_dim, num_heads, num_kv_heads) -> None:
    """With several sequences per thread, the AVX-512 copy gives each work item a whole sequence
    (every kv head of a block read together) instead of one kv head: same numbers."""
    gen = torch.Generator().manual_seed(3)
    lens = [int(x) for x in torch.randint(1, 400, (40,), generator=gen)] + [16, 32, 1]
    query, k_cache, v_cache, tables, seq_lens, keys, values = paged_case(
        lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, dtype=dtype)
    scale = head_dim**-0.5
    got = cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), dense_decode(query, keys, values, scale), atol=tolerance, rtol=tolerance)


def test_long_sequences_with_peaked_scores() -> None:
    """Scores of magnitude ~100 whose maximum keeps moving: the running max and the rescaling
    across hundreds of blocks must be exact, and tiny weights must not turn into NaN."""
    query, k_cache, v_cache, tables, seq_lens, keys, values = paged_case(
        [4000, 2500, 17], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        query_scale=12.0, seed=1)
    got = cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, 64**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_decode(query, keys, values, 64**-0.5), atol=1e-5, rtol=1e-5)


def windowed_decode(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                    window: int, softcap: float) -> torch.Tensor:
    """float64 reference with a sliding window (the last ``window`` keys) and soft-capped scores."""
    out = []
    for i, (k, v) in enumerate(zip(keys, values)):
        group = query.shape[1] // k.shape[1]
        k64 = k[-window:].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v64 = v[-window:].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i].double(), k64) * scale
        scores = softcap * torch.tanh(scores / softcap)
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v64))
    return torch.stack(out)


@pytest.mark.parametrize("head_dim", [64, 96, 80])  # 80: not a multiple of 32, the widening copy
def test_bf16_caches_with_windows_softcaps_and_peaked_scores(head_dim) -> None:
    """A bf16 cache on an AVX512-BF16 CPU attends with bf16 dot products (q and the probabilities
    rounded to bf16; elsewhere the widening copy): the window's first block partly masked, blocks
    before it poisoned with NaN, a last block of odd length, scores of magnitude ~50 whose
    maximum keeps moving, and soft-capping, all within bf16's own rounding of the output. The
    slots past each sequence's end hold NaN: the kernel must not read them."""
    lens = [1, 17, 33, 250, 1031]
    window, softcap = 41, 30.0
    query, k_cache, v_cache, tables, seq_lens, keys, values = paged_case(
        lens, num_heads=12, num_kv_heads=4, head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
        query_scale=6.0, seed=5)
    for i, length in enumerate(lens):  # what the engine's freeing leaves before each window
        for index in range(max(0, length - window) // 16):
            block = int(tables[i, index])
            k_cache[block], v_cache[block] = float("nan"), float("nan")
        if length % 16:
            last = int(tables[i, length // 16])
            k_cache[last, length % 16:], v_cache[last, length % 16:] = float("nan"), float("nan")
    scale = head_dim**-0.5
    got = cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, scale,
                                                sliding_window=window, softcap=softcap)
    assert torch.isfinite(got).all()
    expected = windowed_decode(query, keys, values, scale, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)


def test_query_may_be_a_strided_view() -> None:
    """The model passes q as a view into the fused q/k rotary output."""
    query, k_cache, v_cache, tables, seq_lens, keys, values = paged_case(
        [5, 40], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    fused = torch.cat([query, torch.zeros(2, 3, 64, dtype=torch.bfloat16)], dim=1)  # [n, H + Hkv, D]
    view = fused[:, :9]
    assert not view.is_contiguous()
    got = cpu_decode.paged_decode_attention_cpu(view, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables,
                                                                          seq_lens, 0.125))


def test_rejects_what_it_cannot_read() -> None:
    query, k_cache, v_cache, tables, seq_lens, _, _ = paged_case(
        [5], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="int32"):
        cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables.long(), seq_lens, 1.0)
    assert not cpu_decode.supports(query.half(), k_cache.half())  # fp16 caches stay on the torch path
    assert not cpu_decode.supports(query, k_cache.transpose(1, 2))  # not the cache layout


def test_one_openmp_runtime_in_the_process() -> None:
    """The kernel's parallel loop must use torch's OpenMP runtime (the step thread's team), not
    load a second one that would fight torch's threads for the cores."""
    code = (
        "import torch; torch.ones(64, 64).sum();"
        "from llmplatform.kernels import cpu_decode; assert cpu_decode.available();"
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l or 'libomp' in l"
        " or 'iomp' in l}))"
    )
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    runtimes = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own subprocess's list)
    assert len(runtimes) == 1, runtimes


def test_without_a_compiler_the_torch_path_serves(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(cpu_decode, "_kernel", None)
    monkeypatch.setattr(cpu_decode, "_error", None)
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="llmplatform.kernels"):
        assert kernels.attention_backend(torch.device("cpu")) is kernels.AttentionBackend.TORCH
        assert kernels.attention_backend(torch.device("cpu")) is kernels.AttentionBackend.TORCH
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "/bin/false" in warnings[0].getMessage()  # once, with the reason
    # forced: an error when the model's ops are chosen, not a silent fallback
    with pytest.raises(cpu_decode.KernelUnavailableError, match="/bin/false"):
        plan_ops("cpu", torch.float32, attention="cpu")
    assert plan_ops("cpu", torch.float32).attention is kernels.AttentionBackend.TORCH  # auto: torch


def test_built_once_then_loaded_from_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "_kernel", None)
    monkeypatch.setattr(cpu_decode, "_error", None)
    assert cpu_decode.available()
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.tmp"))

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(cpu_decode, "_kernel", None)
    monkeypatch.setattr(cpu_decode.subprocess, "run", no_compiler)
    assert cpu_decode.available()


def test_engine_greedy_output_equals_the_torch_backend(tiny_model_dir, monkeypatch) -> None:
    """Prefill, chunked prefill over a cached prefix, mixed and decode-only steps. In float32: in
    bf16 the two paths round differently (the kernel once, from float32; torch's bf16 attention
    along the way) and a random tiny model's near-tied logits can then pick other tokens; the bf16
    numbers are checked against a float64 reference above."""
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=16, num_blocks=48),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)))

    def greedy(e: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        tokens = run_to_completion(e, prompts, [params] * len(prompts))  # also asserts the engine drained
        return [tokens[str(i)] for i in range(len(prompts))]

    calls: Counter[str] = Counter()
    real = cpu_decode.paged_decode_attention_cpu

    def counting(query, *args, **kwargs):
        calls["rows"] += query.shape[0]
        return real(query, *args, **kwargs)

    monkeypatch.setattr(cpu_decode, "paged_decode_attention_cpu", counting)
    monkeypatch.setenv(BACKEND_ENV_VAR, "cpu")
    first = engine()
    words = "the quick brown fox jumps over the lazy dog while one two three rivers run".split()
    prompts = [first.tokenizer(" ".join(words[:n] * reps))["input_ids"] for n, reps in
               ((3, 1), (14, 1), (9, 3), (16, 5), (2, 1))]
    on_kernel = greedy(first, prompts)
    assert calls["rows"] > 0
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    calls.clear()
    on_torch = greedy(engine(), prompts)
    assert calls["rows"] == 0
    assert on_kernel == on_torch
    assert all(len(tokens) == 12 for tokens in on_kernel)
