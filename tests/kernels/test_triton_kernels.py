"""The Triton kernels against their torch references: interpreted on CPU (TRITON_INTERPRET=1),
compiled on CUDA (``gpu`` cases, skipped without a device). Compilation for sm_80 / sm_90
without a device: test_triton_compile.py.

The grid is a covering design, not a cartesian product (which would take hours interpreted).
Each case is one row of values for the axes

    head_dim 64 | 128,  num_kv_heads 1 | 2 | 8,  queries per kv head 1 | 4 | 8,
    block_size 16 | 32,  dtype float32 | bfloat16,  split-K off (1) | on (2, 4, 8, 16; decode)

with a small decode batch and a small prefill batch that mix the lengths 1, 15, 16, 17, 100 and
over 1,000 (plus block and tile edges 31, 32, 33, 64, 65, and one head_dim of 96). Every
(num_kv_heads, queries per kv head) pair has a case, and every value of every axis appears in
several cases with different partners (``test_grid_covers_every_value_in_several_combinations``
checks it). Batches use shuffled, non-contiguous block tables that include block 0 (the padding
id), and the caches hold finite garbage everywhere else, so a missing mask shows up as a wrong
number.

Tolerances: float32 5e-5 (abs and rel; online vs dense softmax differ by ~1e-6 interpreted);
bfloat16 2e-2 (abs and rel, about two bf16 ulps: the kernels round the softmax weights to bf16
for the P @ V dot, as flash attention does, and the reference does not).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import triton  # noqa: E402,F401  (the test extra installs it: a broken install must fail, not skip)

from llmplatform.kernels import (  # noqa: E402
    AttentionBackend,
    AttentionMetadata,
    attention_backend,
    paged_attention,
    store_kv_cache,
)
from llmplatform.kernels.attention import paged_attention_torch  # noqa: E402
from llmplatform.kernels.cache_ops import store_kv_cache_torch  # noqa: E402

TOLERANCES = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
F32, BF16 = torch.float32, torch.bfloat16


# =============================================================================================
# Batches


@dataclass
class Batch:
    """A paged KV cache with the K/V of every sequence's first ``context + query`` positions
    in place, and the metadata of a step that computes the last ``query`` of them."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim] the new tokens' K (already stored)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float


def make_batch(
    lens: list[tuple[int, int]],  # (context_len, query_len) per sequence
    *,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    strided_query: bool = False,
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads = num_kv_heads * queries_per_kv
    blocks_needed = [-(-(c + q) // block_size) for c, q in lens]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))  # shuffled: non-contiguous tables, block 0 in use too
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)  # garbage where unused
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    metadata = AttentionMetadata.build(
        context_lens=[c for c, _ in lens], query_lens=[q for _, q in lens], block_tables=tables,
        block_size=block_size, device=device,
    )
    num_tokens = metadata.num_tokens
    if strided_query:  # q, k, v as views of one fused projection, as the model makes them
        qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    else:
        query = randn(num_tokens, num_heads, head_dim)
        key = randn(num_tokens, num_kv_heads, head_dim)
        value = randn(num_tokens, num_kv_heads, head_dim)
    # The cached prefixes were written by earlier steps; the new tokens by store_kv_cache.
    store_kv_cache_torch(key, value, k_cache, v_cache, metadata.slot_mapping.cpu())
    on = lambda t: t.to(device)  # noqa: E731  (a copy keeps a CPU view's strides only on CPU)
    return Batch(on(query), on(key), on(value), on(k_cache), on(v_cache), metadata, head_dim**-0.5)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **TOLERANCES[expected.dtype])


# =============================================================================================
# The covering grid


@dataclass(frozen=True)
class Case:
    head_dim: int
    num_kv_heads: int
    queries_per_kv: int
    block_size: int
    dtype: torch.dtype
    num_kv_splits: int  # decode only: 1 = split-K off
    decode_lens: tuple[int, ...]  # KV lengths of a decode batch
    prefill_lens: tuple[tuple[int, int], ...]  # (context_len, query_len) of a prefill batch

    @property
    def id(self) -> str:
        return (f"d{self.head_dim}-kv{self.num_kv_heads}x{self.queries_per_kv}-bs{self.block_size}-"
                f"{str(self.dtype)[6:]}-split{self.num_kv_splits}")


LONG = 1031  # "over 1,000": 32 full tiles and 7 positions, 64 blocks of 16 and 7 positions
CASES = [
    #    D  Hkv  G  bs  dtype split  decode KV lengths       prefill (context, query)
    Case(64, 1, 1, 16, F32, 1, (1, 15, 16, 17, 100, LONG), ((0, 1), (0, 15), (0, 16), (0, 17), (0, 100))),
    Case(128, 1, 4, 32, BF16, 4, (LONG, 16, 1), ((LONG, 17), (0, 33), (15, 1))),
    Case(64, 1, 8, 32, F32, 4, (15, 17, 100, 33), ((16, 17), (0, 100), (100, 1))),
    Case(128, 2, 1, 16, BF16, 1, (100, 1, 17, 64), ((0, 1040),)),
    Case(64, 2, 4, 16, BF16, 16, (1, 16, LONG), ((LONG, 16), (17, 15), (0, 1))),
    Case(128, 2, 8, 32, F32, 1, (17, 15, 32), ((0, 16), (1, 100), (31, 2))),
    Case(64, 8, 1, 32, BF16, 4, (16, 100, 15, 1), ((0, 17), (64, 33), (16, 1))),
    Case(128, 8, 4, 16, F32, 4, (LONG, 17), ((100, 15), (0, 16), (1, 1))),
    Case(64, 8, 8, 16, F32, 1, (1, 100, 31), ((0, 15), (15, 17), (LONG, 1))),
    Case(128, 2, 4, 32, F32, 16, (100, LONG, 15), ((0, 100), (17, 1))),
    Case(64, 1, 4, 16, BF16, 1, (LONG, 16), ((LONG, 1), (0, 17), (16, 16))),
    Case(128, 8, 8, 32, BF16, 2, (LONG + 100, 33, 1), ((0, 64), (33, 31), (LONG, 3))),
    Case(96, 2, 1, 32, F32, 8, (16, 17, 2048), ((0, 65), (16, 16), (100, 1))),  # head_dim not a power of 2
]
GRID = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


def test_grid_covers_every_value_in_several_combinations() -> None:
    axes = {
        "head_dim": (64, 128), "num_kv_heads": (1, 2, 8), "queries_per_kv": (1, 4, 8),
        "block_size": (16, 32), "dtype": (F32, BF16),
    }
    for axis, values in axes.items():
        for value in values:
            assert sum(getattr(c, axis) == value for c in CASES) >= 2, (axis, value)
    assert {(c.num_kv_heads, c.queries_per_kv) for c in CASES} == {(h, g) for h in (1, 2, 8) for g in (1, 4, 8)}
    assert sum(c.num_kv_splits == 1 for c in CASES) >= 3 and sum(c.num_kv_splits > 1 for c in CASES) >= 3
    decode = [n for c in CASES for n in c.decode_lens]
    seq = [sum(cq) for c in CASES for cq in c.prefill_lens]
    for length in (1, 15, 16, 17, 100):
        assert decode.count(length) >= 2 and seq.count(length) >= 1, length
    assert sum(n > 1000 for n in decode) >= 3 and sum(n > 1000 for n in seq) >= 3
    assert sum(c > 0 and q > 1 for case in CASES for c, q in case.prefill_lens) >= 5  # chunked prefills


def batch_of(case: Case, lens, device: torch.device, **kwargs) -> Batch:
    return make_batch(lens, num_kv_heads=case.num_kv_heads, queries_per_kv=case.queries_per_kv,
                      head_dim=case.head_dim, block_size=case.block_size, dtype=case.dtype,
                      device=device, **kwargs)


# =============================================================================================
# Kernels against their references


@GRID
def test_decode_kernel_matches_reference(case: Case, triton_device: torch.device) -> None:
    from llmplatform.kernels.triton_decode_attention import (
        paged_decode_attention_torch,
        paged_decode_attention_triton,
    )

    b = batch_of(case, [(n - 1, 1) for n in case.decode_lens], triton_device, strided_query=case.head_dim == 64)
    args = (b.query, b.k_cache, b.v_cache, b.metadata.block_tables, b.metadata.seq_lens,
            b.metadata.max_seq_len, b.scale)
    got = paged_decode_attention_triton(*args, num_kv_splits=case.num_kv_splits)
    assert_close(got, paged_decode_attention_torch(*args))


@GRID
def test_prefill_kernel_matches_reference(case: Case, triton_device: torch.device) -> None:
    from llmplatform.kernels.triton_prefill_attention import (
        paged_prefill_attention_torch,
        paged_prefill_attention_triton,
    )

    b = batch_of(case, list(case.prefill_lens), triton_device, strided_query=case.head_dim == 128)
    m = b.metadata
    args = (b.query, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc, m.seq_lens, m.max_query_len, b.scale)
    assert_close(paged_prefill_attention_triton(*args), paged_prefill_attention_torch(*args))


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16], ids=str)
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(1, 64, 16), (2, 128, 32), (8, 64, 32), (3, 80, 16)])
def test_store_kv_kernel_matches_reference(num_kv_heads, head_dim, block_size, dtype, triton_device) -> None:
    from llmplatform.kernels.triton_store_kv import store_kv_cache_reference, store_kv_cache_triton

    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 37
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # any slots, any order
    caches = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected = caches.clone()
    store_kv_cache_reference(key, value, expected[0], expected[1], slots)

    got = caches.to(triton_device)
    store_kv_cache_triton(key.to(triton_device), value.to(triton_device), got[0], got[1], slots.to(triton_device))
    assert torch.equal(got.cpu(), expected)  # a copy: bit-exact, untouched slots too


# =============================================================================================
# The dispatch: the public ops on the Triton backend


@pytest.mark.parametrize("batch", ["decode_only", "mixed"])
def test_public_ops_on_the_triton_backend_match_the_torch_backend(batch: str, triton_device: torch.device,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    lens = ([(0, 1), (16, 1), (300, 1), (40, 1)] if batch == "decode_only"
            else [(0, 20), (16, 1), (33, 17), (300, 1), (0, 1)])
    b = make_batch(lens, num_kv_heads=2, queries_per_kv=4, head_dim=64, block_size=16, dtype=F32,
                   device=triton_device, strided_query=True)
    assert b.metadata.is_decode_only == (batch == "decode_only")
    # Wipe the new tokens' slots: store_kv_cache (on the Triton backend) must write them back.
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    slots = b.metadata.slot_mapping
    k_cache.view(-1, 2, 64)[slots] = 0
    v_cache.view(-1, 2, 64)[slots] = 0
    store_kv_cache(b.key, b.value, k_cache, v_cache, slots, backend=AttentionBackend.TRITON)
    assert torch.equal(k_cache, b.k_cache) and torch.equal(v_cache, b.v_cache)
    got = paged_attention(b.query, b.key, b.value, k_cache, v_cache, b.metadata, b.scale,
                          backend=AttentionBackend.TRITON)

    expected = paged_attention(b.query, b.key, b.value, k_cache, v_cache, b.metadata, b.scale,
                               backend=AttentionBackend.TORCH)
    assert_close(got, expected)
    assert_close(got, paged_attention_torch(b.query, b.key, b.value, k_cache, v_cache, b.metadata, b.scale))


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default per device, and the forced ones, as a model's ops plan resolves them (the
    environment variable is read into the engine's config: tests/engine/test_decode_path.py)."""
    from llmplatform.kernels import cpu_decode
    from llmplatform.kernels.ops import plan_ops
    from tests.kernels.conftest import has_c_compiler, require_cpu_kernel

    if has_c_compiler():
        require_cpu_kernel(cpu_decode.kernel)  # where a compiler exists the kernel must build
    expected_cpu = AttentionBackend.CPU if has_c_compiler() else AttentionBackend.TORCH
    assert attention_backend(torch.device("cpu")) is expected_cpu  # the C kernel where it builds
    assert attention_backend(torch.device("cuda")) is AttentionBackend.TRITON  # triton is installed here
    assert plan_ops("cpu", torch.float32).attention is expected_cpu
    assert plan_ops("cuda", torch.float32).attention is AttentionBackend.TRITON
    if has_c_compiler():
        assert plan_ops("cpu", torch.float32, attention="cpu").attention is AttentionBackend.CPU
    assert plan_ops("cuda", torch.float32, attention="torch").attention is AttentionBackend.TORCH
    assert plan_ops("cpu", torch.float32, attention=" Triton ").attention is AttentionBackend.TRITON
    with pytest.raises(ValueError, match="expected one of auto, triton, cpu, torch"):
        plan_ops("cpu", torch.float32, attention="cuda")


def test_compiled_kernels_refuse_cpu_tensors_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    from llmplatform.kernels import check_triton_launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    @triton.jit
    def compiled(x_ptr):  # built with TRITON_INTERPRET unset: a compiled kernel
        pass

    if type(compiled).__name__ == "InterpretedFunction":
        pytest.skip("the whole process runs under TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_triton_launch(compiled, x=torch.zeros(1))


# =============================================================================================
# Launcher checks and the split heuristic (no kernel runs)


def test_launchers_check_shapes_dtypes_strides_and_devices(triton_device: torch.device) -> None:
    from llmplatform.kernels.triton_decode_attention import paged_decode_attention_triton as decode
    from llmplatform.kernels.triton_prefill_attention import paged_prefill_attention_triton as prefill
    from llmplatform.kernels.triton_store_kv import store_kv_cache_triton as store

    b = make_batch([(3, 1), (20, 1)], num_kv_heads=2, queries_per_kv=2, head_dim=64, block_size=16,
                   dtype=F32, device=triton_device)
    m = b.metadata
    ok = (b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, m.max_seq_len, b.scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode(b.query[:, :3], *ok[1:])
    with pytest.raises(TypeError, match="share one dtype"):
        decode(b.query.half(), *ok[1:])
    with pytest.raises(TypeError, match="int32"):
        decode(*ok[:4], m.seq_lens.long(), *ok[5:])
    with pytest.raises(ValueError, match="block_tables"):
        decode(*ok[:3], m.block_tables[:1], *ok[4:])
    with pytest.raises(ValueError, match="contiguous last dim"):
        decode(b.query.transpose(1, 2).contiguous().transpose(1, 2), *ok[1:])
    with pytest.raises(ValueError, match="power of two"):
        decode(*ok, num_kv_splits=3)
    with pytest.raises(ValueError, match="one device"):
        decode(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens.to("meta"), m.max_seq_len, b.scale)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill(b.query, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc[:-1], m.seq_lens, 1, b.scale)
    with pytest.raises(TypeError, match="float32|dtype"):
        store(b.key.double(), b.value.double(), b.k_cache.double(), b.v_cache.double(), m.slot_mapping)


def test_split_heuristic_splits_only_few_long_sequences() -> None:
    from llmplatform.kernels.triton_decode_attention import MAX_KV_SPLITS, choose_num_kv_splits

    h200 = 132  # streaming multiprocessors
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=32768, num_sms=h200) == MAX_KV_SPLITS
    assert choose_num_kv_splits(num_seqs=4, num_kv_heads=8, max_seq_len=4096, num_sms=h200) == 8
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=600, num_sms=h200) == 2
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=200, num_sms=h200) == 1  # short
    assert choose_num_kv_splits(num_seqs=64, num_kv_heads=8, max_seq_len=32768, num_sms=h200) == 1  # full
    for seqs in (1, 3, 17, 300):
        for length in (1, 255, 256, 1000, 5000, 100_000):
            n = choose_num_kv_splits(seqs, 2, length, h200)
            assert 1 <= n <= MAX_KV_SPLITS and n & (n - 1) == 0


# =============================================================================================
# Sliding window and soft-capping


def forget_blocks_before_windows(b: Batch, window: int, block_size: int) -> None:
    """What the engine's freeing leaves: each block wholly before the window of a sequence's
    first query of the step is NaN-filled, and its table entry names a NaN block or is the
    placeholder -1: a kernel that reads one shows NaN."""
    tables = b.metadata.block_tables
    nan_block = min(set(range(b.k_cache.shape[0])) - set(tables.flatten().tolist()))  # a spare block
    b.k_cache[nan_block] = float("nan")
    b.v_cache[nan_block] = float("nan")
    for i, context_len in enumerate(b.metadata.context_lens_cpu):
        for index in range(max(0, context_len - window + 1) // block_size):
            b.k_cache[int(tables[i, index])] = float("nan")
            b.v_cache[int(tables[i, index])] = float("nan")
            tables[i, index] = nan_block if index % 2 else -1


WINDOW_CASES = [  # (window, softcap, block_size, num_kv_splits, dtype)
    (16, None, 16, 1, F32), (33, 2.5, 16, 4, F32), (5, None, 32, 2, F32), (None, 3.0, 16, 1, F32),
    (40, 10.0, 32, 4, BF16), (2000, None, 16, 2, F32),
]


@pytest.mark.parametrize("window,softcap,block_size,num_kv_splits,dtype", WINDOW_CASES,
                         ids=[f"w{w}-cap{c}-bs{bs}-split{s}-{str(d)[6:]}" for w, c, bs, s, d in WINDOW_CASES])
def test_windowed_softcapped_kernels_match_the_dense_torch_path(window, softcap, block_size, num_kv_splits, dtype,
                                                                triton_device: torch.device) -> None:
    """Decode (split-K on and off) and prefill (from scratch, chunks reaching back into the
    cache, decode rows beside them) against the torch path, which is checked against dense
    attention (test_attention_reference.py); the blocks before each window are poisoned."""
    from llmplatform.kernels.triton_decode_attention import paged_decode_attention_triton

    def torch_path(b: Batch) -> torch.Tensor:
        cpu = lambda t: t.cpu()  # noqa: E731
        return paged_attention_torch(cpu(b.query), cpu(b.key), cpu(b.value), cpu(b.k_cache), cpu(b.v_cache),
                                     _metadata_on_cpu(b.metadata), b.scale, sliding_window=window, softcap=softcap)

    kwargs = dict(num_kv_heads=2, queries_per_kv=4, head_dim=64, block_size=block_size, dtype=dtype,
                  device=triton_device)
    decode = make_batch([(0, 1), (15, 1), (16, 1), (40, 1), (300, 1), (1030, 1)], **kwargs)
    if window is not None:
        forget_blocks_before_windows(decode, window, block_size)
    m = decode.metadata
    got = paged_decode_attention_triton(decode.query, decode.k_cache, decode.v_cache, m.block_tables, m.seq_lens,
                                        m.max_seq_len, decode.scale, num_kv_splits=num_kv_splits,
                                        sliding_window=window, softcap=softcap)
    assert_close(got, torch_path(decode))

    prefill = make_batch([(0, 70), (37, 20), (100, 3), (16, 1), (5, 40), (200, 1)], seed=1, **kwargs)
    if window is not None:
        forget_blocks_before_windows(prefill, window, block_size)
    got = paged_attention(prefill.query, prefill.key, prefill.value, prefill.k_cache, prefill.v_cache,
                          prefill.metadata, prefill.scale, backend=AttentionBackend.TRITON,
                          sliding_window=window, softcap=softcap)
    assert_close(got, torch_path(prefill))


def _metadata_on_cpu(m: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=m.slot_mapping.cpu(), query_start_loc=m.query_start_loc.cpu(), seq_lens=m.seq_lens.cpu(),
        context_lens=m.context_lens.cpu(), block_tables=m.block_tables.cpu(), max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens_cpu=m.seq_lens_cpu,
        context_lens_cpu=m.context_lens_cpu, is_decode_only=m.is_decode_only,
    )
