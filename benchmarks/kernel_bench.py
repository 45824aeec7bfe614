"""Kernel benchmark: the Triton kernels against the torch path and against PyTorch's SDPA.

    python benchmarks/kernel_bench.py [--quick] [--dtype bfloat16] [--json-out FILE]
    python benchmarks/kernel_bench.py --device cpu      # smoke run of this script, interpreted, tiny

Shapes are a Llama-3-8B layer's (32 query heads, 8 kv heads, head_dim 128), block_size 16, in
bf16 unless ``--dtype`` says otherwise. Each sequence's blocks are a random permutation of the
pool, as after a long serving run. For each case three things are timed (median of CUDA-event
timed repeats, after warm-up, so the torch path's per-step plan is built before timing):

- ``triton``: the launcher (``paged_decode_attention_triton``, ``paged_prefill_attention_triton``,
  ``store_kv_cache_triton``); decode twice, with the split-K heuristic and with split-K off;
- ``torch``: the torch reference path the CPU serves with (``paged_attention_torch``,
  ``store_kv_cache_torch``), the same op on the same paged cache;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on unpaged, contiguous K/V
  ([batch, kv_heads, seq_len, head_dim], GQA through ``enable_gqa``): what the same attention
  costs without paging (for store_kv: a contiguous ``copy_`` of the same bytes).

Every Triton output is checked against the torch path first (max abs error, printed).

Decode is memory bound: its effective bandwidth is the bytes of K and V it must read
(batch x seq_len x kv_heads x head_dim x 2 x element size) per second, reported as a fraction of
the device's measured copy bandwidth (bytes read + written per second by a 2 GiB
``Tensor.copy_``, the practical ceiling). Prefill reports TFLOP/s over the causal work.

Prints one table per kernel and a last line ``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    # Triton on CPU is the interpreter, chosen when the kernels are imported (below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from llmplatform.kernels import AttentionMetadata  # noqa: E402
from llmplatform.kernels.attention import paged_attention_torch  # noqa: E402
from llmplatform.kernels.cache_ops import store_kv_cache_torch  # noqa: E402
from llmplatform.kernels.triton_decode_attention import (  # noqa: E402
    choose_num_kv_splits,
    paged_decode_attention_triton,
)
from llmplatform.kernels.triton_prefill_attention import paged_prefill_attention_triton  # noqa: E402
from llmplatform.kernels.triton_store_kv import store_kv_cache_triton  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16

# (batch, seq_len): one long sequence ... many short ones, each 128 MiB - 1 GiB of bf16 K+V.
DECODE_CASES = [(1, 65536), (4, 16384), (16, 8192), (64, 2048), (256, 1024)]
DECODE_QUICK = [(1, 32768), (16, 4096), (256, 1024)]
# (batch, context_len, query_len): fresh prompts and chunks over a cached prefix.
PREFILL_CASES = [(1, 0, 8192), (8, 0, 2048), (4, 8192, 512), (16, 1024, 128)]
PREFILL_QUICK = [(4, 0, 2048), (4, 4096, 512)]
STORE_CASES = [256, 8192]
CPU_SMOKE = dict(decode=[(2, 40)], prefill=[(2, 0, 20), (1, 30, 5)], store=[16])


# =============================================================================================
# Timing


def timed(fn, device: torch.device, *, warmup: int = 3, repeat: int = 20) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(max(1, repeat // 10)):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by one large device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, warmup=3, repeat=10)
    return 2 * nbytes / seconds


# =============================================================================================
# Inputs


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, H, D]
    key: torch.Tensor  # [num_tokens, Hkv, D] (already in the cache)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    tables: list[list[int]]
    scale: float


def paged_batch(lens: list[tuple[int, int]], dtype: torch.dtype, device: torch.device, seed: int = 0) -> PagedBatch:
    """(context_len, query_len) per sequence; every position's K/V in the cache."""
    rng = random.Random(seed)
    blocks = [-(-(c + q) // BLOCK_SIZE) for c, q in lens]
    num_blocks = sum(blocks) + 1
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    k_cache = randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    metadata = AttentionMetadata.build(context_lens=[c for c, _ in lens], query_lens=[q for _, q in lens],
                                       block_tables=tables, block_size=BLOCK_SIZE, device=device)
    num_tokens = metadata.num_tokens
    query = randn(num_tokens, NUM_HEADS, HEAD_DIM)
    key = randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    store_kv_cache_torch(key, value, k_cache, v_cache, metadata.slot_mapping)
    return PagedBatch(query, key, value, k_cache, v_cache, metadata, tables, HEAD_DIM**-0.5)


def unpaged_kv(b: PagedBatch, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous [batch, Hkv, seq_len, D] copies of equal-length sequences' K/V."""
    positions = torch.arange(seq_len, device=b.k_cache.device)
    tables = b.metadata.block_tables.long()  # [batch, max_blocks]
    slots = tables[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE  # [batch, L]
    k = b.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    v = b.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    return k, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except (TypeError, RuntimeError):  # no enable_gqa here: stride-0 expand of K/V instead
        g = q.shape[1] // k.shape[1]
        k = k.unsqueeze(2).expand(-1, -1, g, -1, -1).flatten(1, 2)
        v = v.unsqueeze(2).expand(-1, -1, g, -1, -1).flatten(1, 2)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item()


# =============================================================================================
# Cases


def bench_decode(batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, copy_bw: float) -> dict:
    b = paged_batch([(seq_len - 1, 1)] * batch, dtype, device)
    m = b.metadata
    args = (b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, m.max_seq_len, b.scale)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    splits = choose_num_kv_splits(batch, NUM_KV_HEADS, seq_len, num_sms)

    def torch_path():
        return paged_attention_torch(b.query, b.key, b.value, b.k_cache, b.v_cache, m, b.scale)

    error = max_error(paged_decode_attention_triton(*args), torch_path())
    t_auto = timed(lambda: paged_decode_attention_triton(*args), device)
    t_nosplit = timed(lambda: paged_decode_attention_triton(*args, num_kv_splits=1), device)
    t_torch = timed(torch_path, device)
    k, v = unpaged_kv(b, seq_len)
    q = b.query.view(batch, NUM_HEADS, 1, HEAD_DIM)
    t_sdpa = timed(lambda: sdpa(q, k, v, scale=b.scale), device)
    kv_bytes = batch * seq_len * NUM_KV_HEADS * HEAD_DIM * 2 * b.k_cache.element_size()
    bandwidth = kv_bytes / t_auto
    return dict(batch=batch, seq_len=seq_len, num_kv_splits=splits, max_abs_error=error,
                triton_ms=t_auto * 1e3, triton_nosplit_ms=t_nosplit * 1e3, torch_ms=t_torch * 1e3,
                sdpa_unpaged_ms=t_sdpa * 1e3, kv_gb_per_s=bandwidth / 1e9,
                fraction_of_copy_bandwidth=bandwidth / copy_bw)


def bench_prefill(batch: int, context_len: int, query_len: int, dtype: torch.dtype, device: torch.device) -> dict:
    b = paged_batch([(context_len, query_len)] * batch, dtype, device)
    m = b.metadata
    args = (b.query, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc, m.seq_lens, m.max_query_len, b.scale)

    def torch_path():
        return paged_attention_torch(b.query, b.key, b.value, b.k_cache, b.v_cache, m, b.scale)

    error = max_error(paged_prefill_attention_triton(*args), torch_path())
    t_triton = timed(lambda: paged_prefill_attention_triton(*args), device, repeat=10)
    t_torch = timed(torch_path, device, repeat=5)
    seq_len = context_len + query_len
    k, v = unpaged_kv(b, seq_len)
    q = b.query.view(batch, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # [B, H, q_len, D]
    if context_len == 0:
        t_sdpa = timed(lambda: sdpa(q, k, v, is_causal=True, scale=b.scale), device, repeat=10)
    else:
        visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=device).tril(context_len)
        t_sdpa = timed(lambda: sdpa(q, k, v, attn_mask=visible, scale=b.scale), device, repeat=10)
    # Each query row i sees context_len + i + 1 keys: QK^T and PV, 2 FLOPs per multiply-add.
    visible_pairs = batch * (query_len * context_len + query_len * (query_len + 1) // 2)
    flops = 4 * NUM_HEADS * HEAD_DIM * visible_pairs
    return dict(batch=batch, context_len=context_len, query_len=query_len, max_abs_error=error,
                triton_ms=t_triton * 1e3, torch_ms=t_torch * 1e3, sdpa_unpaged_ms=t_sdpa * 1e3,
                triton_tflops=flops / t_triton / 1e12)


def bench_store(num_tokens: int, dtype: torch.dtype, device: torch.device) -> dict:
    num_blocks = max(64, 4 * num_tokens // BLOCK_SIZE)
    gen = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    key = qkv[:, NUM_HEADS:NUM_HEADS + NUM_KV_HEADS]  # strided views, as the model passes them
    value = qkv[:, NUM_HEADS + NUM_KV_HEADS:]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:num_tokens]
    store_kv_cache_triton(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_cache_torch(key, value, expected_k, expected_v, slots)
    exact = bool(torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v))
    t_triton = timed(lambda: store_kv_cache_triton(key, value, k_cache, v_cache, slots), device)
    t_torch = timed(lambda: store_kv_cache_torch(key, value, k_cache, v_cache, slots), device)
    flat = torch.empty(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    t_copy = timed(lambda: (flat[0].copy_(key), flat[1].copy_(value)), device)
    moved = 2 * 2 * num_tokens * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()  # K and V, read + write
    return dict(num_tokens=num_tokens, exact=exact, triton_us=t_triton * 1e6, torch_us=t_torch * 1e6,
                contiguous_copy_us=t_copy * 1e6, triton_gb_per_s=moved / t_triton / 1e9)


# =============================================================================================
# Report


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{title}")
    keys = list(rows[0])
    cells = [[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (interpreted smoke run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quick", action="store_true", help="fewer cases (for benchmarks/gpu_check.sh)")
    parser.add_argument("--json-out", default=None, help="also write the result JSON to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or --device cpu for an interpreted smoke run")

    if device.type == "cpu":
        decode_cases, prefill_cases, store_cases = CPU_SMOKE["decode"], CPU_SMOKE["prefill"], CPU_SMOKE["store"]
        copy_bytes = 64 << 20
    elif args.quick:
        decode_cases, prefill_cases, store_cases = DECODE_QUICK, PREFILL_QUICK, STORE_CASES
        copy_bytes = 2 << 30
    else:
        decode_cases, prefill_cases, store_cases = DECODE_CASES, PREFILL_CASES, STORE_CASES
        copy_bytes = 2 << 30

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    import triton

    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, "
          f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE}")
    copy_bw = copy_bandwidth(device, copy_bytes)
    print(f"measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)")

    decode = [bench_decode(b, n, dtype, device, copy_bw) for b, n in decode_cases]
    print_table("decode (one query per sequence)", decode)
    prefill = [bench_prefill(b, c, q, dtype, device) for b, c, q in prefill_cases]
    print_table("prefill (causal over cached prefix + new tokens)", prefill)
    store = [bench_store(n, dtype, device) for n in store_cases]
    print_table("store_kv", store)

    result = dict(device=name, dtype=args.dtype, torch=torch.__version__, triton=triton.__version__,
                  copy_gb_per_s=copy_bw / 1e9, decode=decode, prefill=prefill, store_kv=store,
                  best_decode_fraction_of_copy_bandwidth=max(r["fraction_of_copy_bandwidth"] for r in decode))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    bad = [r for r in decode + prefill if not math.isfinite(r["max_abs_error"]) or r["max_abs_error"] > tolerance]
    bad += [r for r in store if not r["exact"]]
    result["all_outputs_match"] = not bad
    line = json.dumps(result)
    print("RESULT_JSON " + line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    if bad:
        sys.exit(f"Triton output differs from the torch path in {len(bad)} case(s)")


if __name__ == "__main__":
    main()
