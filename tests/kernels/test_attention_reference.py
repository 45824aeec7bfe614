"""paged_attention and store_kv_cache against a naive dense attention, on randomized batches.

Every test runs on both CPU backends: ``cpu`` (decode rows by the C kernel, ``cpu_decode``) and
``torch`` (the pure torch path). The sliding-window cases also put NaN-filled or placeholder
(-1) blocks in the table entries before each sequence's window, as the engine does once it frees
them: a kernel that reads them shows NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmplatform.kernels import AttentionBackend, AttentionMetadata, paged_attention, store_kv_cache
from llmplatform.kernels.attention import _get_plan
from tests.kernels.conftest import require_cpu_kernel

HEAD_DIM = 32


BACKEND = {"now": AttentionBackend.TORCH}  # the backend of the running test (the fixture below)


@pytest.fixture(autouse=True, params=["cpu", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpu":
        require_cpu_kernel()
    monkeypatch.setitem(BACKEND, "now", AttentionBackend(request.param))
    return request.param


def naive_attention(
    query: torch.Tensor,  # [q_len, num_heads, D] the new tokens
    keys: torch.Tensor,  # [seq_len, num_kv_heads, D] the whole sequence
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [q_len, num_heads, D]
    """Dense float32 attention of the last q_len positions over all seq_len, causal (within the
    window: p - W < j <= p), soft-capped scores, GQA by repeat."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    context_len = seq_len - q_len
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)  # [seq_len, H, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # [H, q_len, seq_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=context_len)
    if sliding_window is not None:
        allowed &= ~torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=context_len - sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    lens: list[tuple[int, int]],  # (context_len, query_len) per sequence
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in lens]
    num_blocks = sum(blocks_needed) + 7
    nan_block = num_blocks - 1  # never in a table; what a freed block's entry may point to
    # Shuffled, non-contiguous tables; block 0 (the padding id) is in use too.
    free = list(range(num_blocks - 1))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]

    # Finite garbage everywhere, so a missing mask shows up as a wrong number.
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    full_k = [torch.randn(c + q, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for c, q in lens]
    full_v = [torch.randn(c + q, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for c, q in lens]
    for (context_len, _), table, k, v in zip(lens, tables, full_k, full_v):
        for pos in range(context_len):  # the cached prefix, written by hand
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]

    metadata = AttentionMetadata.build(
        context_lens=[c for c, _ in lens], query_lens=[q for _, q in lens],
        block_tables=tables, block_size=block_size,
    )
    key = torch.cat([k[c:] for (c, _), k in zip(lens, full_k)])  # [T, Hkv, D]
    value = torch.cat([v[c:] for (c, _), v in zip(lens, full_v)])
    query = torch.randn(key.shape[0], num_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5

    store_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, backend=BACKEND["now"])
    if sliding_window is not None:
        forget_blocks_before_windows(metadata, k_cache, v_cache, sliding_window, block_size, nan_block)
    out = paged_attention(query, key, value, k_cache, v_cache, metadata, scale, backend=BACKEND["now"],
                          sliding_window=sliding_window, softcap=softcap)
    assert out.shape == query.shape and out.dtype == dtype

    starts = metadata.query_start_loc_cpu
    expected = torch.cat([
        naive_attention(query[starts[i]:starts[i + 1]], full_k[i], full_v[i], scale, sliding_window, softcap)
        for i in range(len(lens))
    ])
    return out, expected, metadata


def forget_blocks_before_windows(metadata: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 window: int, block_size: int, nan_block: int) -> None:
    """What the engine's freeing leaves: each block wholly before the window of a sequence's first
    query of the step is NaN-filled (reused by someone, then poisoned here) and its table entry
    points to the NaN block or is the placeholder -1, alternately."""
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    for i, context_len in enumerate(metadata.context_lens_cpu):
        num_dead = max(0, context_len - window + 1) // block_size
        for index in range(num_dead):
            block = int(metadata.block_tables[i, index])
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")
            metadata.block_tables[i, index] = nan_block if index % 2 else -1


GQA = pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
BLOCK = pytest.mark.parametrize("block_size", [16, 4])


@GQA
@BLOCK
def test_decode_only(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    lens = [(0, 1), (15, 1), (16, 1), (17, 1), (40, 1), (3, 1), (63, 1)]
    out, expected, metadata = run_case(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert metadata.is_decode_only
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@GQA
@BLOCK
def test_prefill_without_prefix(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    lens = [(0, 5), (0, 16), (0, 33), (0, 2)]
    out, expected, _ = run_case(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@GQA
@BLOCK
def test_chunked_prefill_with_cached_prefix(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    lens = [(7, 9), (16, 16), (30, 5), (1, 2)]
    out, expected, _ = run_case(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@GQA
@BLOCK
def test_mixed_batch(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    lens = [(20, 1), (0, 12), (9, 1), (33, 7), (0, 1), (47, 1)]
    out, expected, metadata = run_case(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert not metadata.is_decode_only
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_batches(seed: int) -> None:
    rng = random.Random(seed)
    lens = [
        (rng.choice([0, rng.randrange(1, 70)]), rng.choice([1, 1, 1, rng.randrange(1, 40)]))
        for _ in range(rng.randrange(1, 12))
    ]
    num_kv_heads = rng.choice([1, 2, 3, 5])
    out, expected, _ = run_case(
        lens, block_size=rng.choice([4, 8, 16]), num_heads=num_kv_heads * rng.choice([1, 2, 3]),
        num_kv_heads=num_kv_heads, seed=seed,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_lengths_far_apart_use_several_buckets(mixed: bool, backend: str) -> None:
    """The torch path buckets decode rows by length; the C kernel takes them all in one call."""
    rng = random.Random(3)
    lens = [(rng.randrange(1, 400), 1) for _ in range(40)] + [(5, 300)] * mixed
    out, expected, metadata = run_case(lens, block_size=16, num_heads=6, num_kv_heads=2, seed=3)
    plan = _get_plan(metadata, torch.empty(1, 16, 2, HEAD_DIM), torch.float32, kernel_decode=backend == "cpu",
                     sliding_window=None)
    if backend == "torch":
        assert len(plan.decode_buckets) > 1 and plan.kernel_decode is None
        assert sum(b.num_seqs for b in plan.decode_buckets) == 40
    else:
        assert not plan.decode_buckets and plan.kernel_decode.block_tables.shape[0] == 40
        assert (plan.kernel_decode.rows is None) == (not mixed)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32_reference() -> None:
    lens = [(30, 1), (0, 20), (17, 6), (64, 1)]
    out, expected, _ = run_case(lens, block_size=16, num_heads=6, num_kv_heads=2, dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_store_kv_cache_writes_exactly_the_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(6, 4, 2, 8)
    v_cache = torch.zeros(6, 4, 2, 8)
    slots = torch.tensor([13, 2, 23, 4], dtype=torch.int64)
    key = torch.randn(4, 2, 8, generator=gen)
    value = torch.randn(4, 2, 8, generator=gen)
    store_kv_cache(key, value, k_cache, v_cache, slots, backend=BACKEND["now"])

    flat_k, flat_v = k_cache.view(24, 2, 8), v_cache.view(24, 2, 8)
    torch.testing.assert_close(flat_k[slots], key, atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots], value, atol=0, rtol=0)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    # block 3, offset 1 is slot 13
    torch.testing.assert_close(k_cache[3, 1], key[0], atol=0, rtol=0)


def test_store_kv_cache_rejects_mismatched_shapes() -> None:
    k_cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError):
        store_kv_cache(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), k_cache, k_cache.clone(),
                       torch.zeros(2, dtype=torch.int64), backend=BACKEND["now"])
    with pytest.raises(TypeError):
        store_kv_cache(torch.zeros(2, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 8, dtype=torch.bfloat16),
                       k_cache, k_cache.clone(), torch.zeros(2, dtype=torch.int64), backend=BACKEND["now"])


def test_metadata_builder() -> None:
    metadata = AttentionMetadata.build(
        context_lens=[0, 5, 3], query_lens=[3, 1, 2], block_tables=[[7], [2, 9], [4, 1]], block_size=4,
    )
    assert metadata.query_start_loc_cpu == [0, 3, 4, 6]
    assert metadata.seq_lens_cpu == [3, 6, 5] and metadata.context_lens_cpu == [0, 5, 3]
    # seq 0: positions 0-2 in block 7; seq 1: position 5 = block 9 offset 1;
    # seq 2: position 3 = block 4 offset 3, position 4 = block 1 offset 0
    assert metadata.slot_mapping.tolist() == [28, 29, 30, 37, 19, 4]
    assert metadata.block_tables.tolist() == [[7, 0], [2, 9], [4, 1]]
    assert metadata.query_start_loc.dtype == torch.int32 and metadata.slot_mapping.dtype == torch.int64
    assert metadata.max_query_len == 3 and metadata.max_seq_len == 6 and not metadata.is_decode_only
    decode = AttentionMetadata.build(context_lens=[4, 0], query_lens=[1, 1], block_tables=[[3, 5], [2]], block_size=4)
    assert decode.is_decode_only and decode.slot_mapping.tolist() == [20, 8]


def test_metadata_builder_rejects_short_block_table() -> None:
    with pytest.raises(ValueError):
        AttentionMetadata.build(context_lens=[3], query_lens=[2], block_tables=[[4]], block_size=4)


WINDOWED = pytest.mark.parametrize("sliding_window,softcap", [(8, None), (5, 2.0), (None, 3.0), (64, None)],
                                   ids=["w8", "w5-softcap", "softcap", "w64-longer-than-seqs"])


@WINDOWED
@GQA
@BLOCK
def test_windowed_and_softcapped_decode(block_size, num_heads, num_kv_heads, sliding_window, softcap) -> None:
    lens = [(0, 1), (4, 1), (7, 1), (8, 1), (15, 1), (16, 1), (17, 1), (40, 1), (63, 1)]
    out, expected, _ = run_case(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@WINDOWED
@GQA
@BLOCK
def test_windowed_and_softcapped_prefill_chunks_and_mixed(block_size, num_heads, num_kv_heads, sliding_window,
                                                          softcap) -> None:
    """Prefill from scratch, chunks over a cached prefix (the window reaching back into it, or
    not), decode rows beside them."""
    lens = [(0, 20), (7, 9), (16, 16), (30, 5), (1, 2), (20, 1), (47, 1), (33, 7), (0, 3)]
    out, expected, _ = run_case(lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_windowed_batches(seed: int) -> None:
    rng = random.Random(100 + seed)
    lens = [
        (rng.choice([0, rng.randrange(1, 120)]), rng.choice([1, 1, 1, rng.randrange(1, 40)]))
        for _ in range(rng.randrange(1, 12))
    ]
    num_kv_heads = rng.choice([1, 2, 3])
    out, expected, _ = run_case(
        lens, block_size=rng.choice([4, 8, 16]), num_heads=num_kv_heads * rng.choice([1, 2, 3]),
        num_kv_heads=num_kv_heads, seed=seed, sliding_window=rng.choice([1, 3, 16, 33]),
        softcap=rng.choice([None, 1.5]),
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_windowed_bfloat16_close_to_float32_reference() -> None:
    lens = [(30, 1), (0, 20), (17, 6), (64, 1)]
    out, expected, _ = run_case(lens, block_size=16, num_heads=6, num_kv_heads=2, dtype=torch.bfloat16,
                                sliding_window=10, softcap=4.0)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_windowed_decode_buckets_read_only_the_window() -> None:
    """The torch path's decode buckets hold the blocks from each sequence's window on: long
    sequences under a short window cost what short ones do."""
    lens = [(500, 1), (37, 1), (1000, 1)]
    _, _, metadata = run_case(lens, block_size=16, num_heads=4, num_kv_heads=2, sliding_window=20)
    plan = _get_plan(metadata, torch.empty(1, 16, 2, HEAD_DIM), torch.float32, kernel_decode=False,
                     sliding_window=20)
    assert max(b.kv_len for b in plan.decode_buckets) <= 32 + 16  # 20 keys span at most 3 blocks
