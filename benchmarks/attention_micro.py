"""Micro-benchmark of the paged attention path the engine runs on this machine.

Shapes are SmolLM2-135M's (9 heads, 3 kv heads, head_dim 64), block_size 16. A "step" builds one
AttentionMetadata and calls paged_attention once per layer (30), each layer with its own KV cache
as in the model (so caches are cold, as they are in serving), and the per-step plan (index
tensors, masks, buckets) is built once and reused. Printed: milliseconds per call (per layer),
averaged over the step including the plan, and the first call alone (which builds the plan).

Each case runs on the CPU backends side by side (``--backends``, default both): ``cpu`` (decode
rows by the C kernel, ``kernels/cpu_decode.py``) and ``torch`` (gather + fused SDPA), with the
torch/cpu time ratio. Prefill rows run the same torch code on both.

    python benchmarks/attention_micro.py [--dtype bfloat16] [--threads N] [--backends cpu,torch]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from llmplatform.kernels import AttentionBackend, AttentionMetadata, paged_attention, store_kv_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE = 9, 3, 64, 30, 16


def make_step(lens: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    blocks = [-(-(c + q) // BLOCK_SIZE) for c, q in lens]
    num_blocks = sum(blocks) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    caches = [
        (torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype),
         torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype))
        for _ in range(NUM_LAYERS)
    ]
    num_tokens = sum(q for _, q in lens)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    value = torch.randn_like(key)

    def build() -> AttentionMetadata:
        return AttentionMetadata.build(
            context_lens=[c for c, _ in lens], query_lens=[q for _, q in lens],
            block_tables=tables, block_size=BLOCK_SIZE,
        )

    return build, (query, key, value, caches)


def bench(name: str, lens: list[tuple[int, int]], dtype: torch.dtype, repeats: int, backends: list[str]) -> None:
    times = {}
    for backend in backends:
        times[backend] = bench_one(f"{name} [{backend}]", lens, dtype, repeats, AttentionBackend(backend))
    if len(times) == 2 and "cpu" in times and "torch" in times:
        print(f"{'':<52} torch / cpu: {times['torch'] / times['cpu']:.2f}x")


def bench_one(name: str, lens: list[tuple[int, int]], dtype: torch.dtype, repeats: int,
              backend: AttentionBackend) -> float:
    build, (query, key, value, caches) = make_step(lens, dtype)
    scale = HEAD_DIM**-0.5

    def step() -> tuple[float, float]:
        metadata = build()
        start = time.perf_counter()
        for layer, (k_cache, v_cache) in enumerate(caches):
            paged_attention(query, key, value, k_cache, v_cache, metadata, scale, backend=backend)
            if layer == 0:
                first = time.perf_counter()
        end = time.perf_counter()
        return (end - start) / len(caches), first - start

    step()  # warm up
    per_call, first_call = min(step() for _ in range(repeats))
    k_cache, v_cache = caches[0]
    metadata = build()
    store = _time(lambda: store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping,
                                          backend=backend), repeats * 5)
    print(f"{name:<52} {per_call * 1e3:8.3f} ms/call   first call (+plan) {first_call * 1e3:7.3f} ms"
          f"   store_kv_cache {store * 1e3:6.3f} ms")
    return per_call


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="cpu,torch", help="comma-separated: cpu, torch (default both)")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE}")

    rng = random.Random(0)
    with torch.inference_mode():
        cases = [
            ("decode 64 seqs x 512 context", [(511, 1)] * 64),
            ("decode 32 seqs x 64..600 context", [(rng.randrange(64, 600), 1) for _ in range(32)]),
            ("decode 64 seqs x 100..800 context", [(rng.randrange(100, 800), 1) for _ in range(64)]),
            ("prefill 8 x 256 (no prefix)", [(0, 256)] * 8),
            ("chunked prefill 8 x 256 new over 256 cached", [(256, 256)] * 8),
            ("mixed: 1 prefill x 256 + 63 decodes x 512", [(0, 256)] + [(511, 1)] * 63),
        ]
        for name, lens in cases:
            bench(name, lens, dtype, args.repeats, backends)


if __name__ == "__main__":
    main()
