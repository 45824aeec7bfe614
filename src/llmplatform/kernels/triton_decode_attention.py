"""Paged decode attention in Triton: one new query token per sequence over its paged KV cache.

Work split (flash-decoding):

    grid = (num_seqs, num_kv_heads, num_kv_splits)

    sequence s, KV positions 0 .. seq_len-1, cut into TILE_N-position tiles:
    | tile 0 | tile 1 | ... | tile t | ...        split k covers tiles [k * tiles_per_split, ...)
    \\____ split 0 ____/\\____ split 1 ____/ ...   tiles_per_split = cdiv(num_tiles, num_kv_splits)

One program takes one (sequence, kv head, split) and all ``queries_per_kv`` query heads of that
kv head at once, as the rows of a [BLOCK_H, head_dim] query tile (BLOCK_H >= 16, the smallest
tl.dot; padding rows are zero and never stored): every K/V element is read from memory once per
kv head, which is what bounds a memory-bound kernel. A tile's positions are gathered through the
block table one position at a time (``block_tables[s][pos // BLOCK_SIZE]``, offset
``pos % BLOCK_SIZE``), so the tile size does not depend on the cache's block size.

With a sliding window W (``WINDOW`` > 0) the tiles start at the one holding the first visible key,
``seq_len - W``: the blocks before it are never read (the engine may have freed them), and the
splits share out the tiles from there. With soft-capping the scores become
``softcap * tanh(q.k * scale / softcap)`` before the mask (``HAS_SOFTCAP``).

Softmax is online, in float32 and in base 2 (``qk_scale = scale * log2(e)``, ``exp2``). With one
split the program normalizes and writes the output. With several, each writes its normalized
partial output and its log-sum-exp (base 2) to float32 scratch, and a second kernel merges the
splits of each (sequence, head): ``out = sum_k 2**(lse_k - m) * o_k / sum_k 2**(lse_k - m)``.
Splits past a short sequence's end have no tiles; they write nothing and the merge skips them.

``choose_num_kv_splits`` picks the split count from the batch and the context length: split only
when (sequences x kv heads) programs cannot fill the device, and never into pieces shorter than
``MIN_TOKENS_PER_SPLIT``.

``paged_decode_attention_torch`` is the reference with the launcher's signature.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmplatform.kernels import check_triton_launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# KV positions per inner-loop tile.
TILE_N = 32
# Split-K heuristic: aim for this many programs per streaming multiprocessor...
PROGRAMS_PER_SM = 2
# ...with splits of at least this many KV positions (below it the partial writes and the merge
# cost more than the parallelism gains)...
MIN_TOKENS_PER_SPLIT = 256
# ...and at most this many splits (a power of two: the merge holds them in one tl.arange).
MAX_KV_SPLITS = 16

# Triton's own library helpers (tl.max, tl.sum, tl.cdiv, tl.zeros) are @triton.jit functions,
# built interpreted or compiled when ``triton`` is first imported; the interpreter can only call
# them if TRITON_INTERPRET was set before that, which a process that imported torch._dynamo first
# (transformers does) cannot promise. So the kernels spell them with builtins: tl.reduce with the
# very combine functions tl.max and tl.sum use (the same code when compiled; the interpreter
# recognizes them and runs numpy reductions), ceil-division by hand, tl.full. Then only the
# kernel modules themselves must be imported under TRITON_INTERPRET to run interpreted.
_max_combine = tl.standard._elementwise_max
_sum_combine = tl.standard._sum_combine


@triton.jit
def scores_base2(dot, qk_scale, softcap_in, softcap_out, HAS_SOFTCAP: tl.constexpr):
    """q.k products -> base-2 softmax scores: ``dot * qk_scale``, or with soft-capping
    ``softcap * tanh(dot * scale / softcap) * log2(e)`` (``softcap_in = scale / softcap``,
    ``softcap_out = softcap * log2(e)``). tanh(x) = 1 - 2 / (e^2x + 1): exact at both
    saturations (e^2x overflowing to inf gives 1), and tl has no tanh builtin."""
    if HAS_SOFTCAP:
        return softcap_out * (1.0 - 2.0 / (tl.exp(2.0 * softcap_in * dot) + 1.0))
    return dot * qk_scale


@triton.jit
def window_start(seq_len, WINDOW: tl.constexpr):
    """The first key the last query of a sequence (position seq_len - 1) may see."""
    if WINDOW > 0:
        return tl.maximum(seq_len - WINDOW, 0)
    return seq_len * 0


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, HEAD_DIM]; written when NUM_KV_SPLITS == 1
    partial_out_ptr,  # [num_seqs, num_heads, NUM_KV_SPLITS, HEAD_DIM_PADDED] fp32; split-K only
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_KV_SPLITS] fp32, base 2; split-K only
    query_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    softcap_in,  # scale / softcap (HAS_SOFTCAP only)
    softcap_out,  # softcap * log2(e) (HAS_SOFTCAP only)
    query_stride_seq,
    query_stride_head,
    out_stride_seq,
    out_stride_head,
    cache_stride_block,  # k_cache and v_cache share strides (checked by the launcher)
    cache_stride_slot,
    cache_stride_head,
    block_tables_stride,
    num_heads,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window; 0: none
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the cache dtype; float32 under the interpreter (no bf16 tl.dot there)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no tf32 rounding
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = window_start(seq_len, WINDOW)
    first_tile = kv_lo // TILE_N
    num_tiles = (seq_len + TILE_N - 1) // TILE_N
    tiles_per_split = (num_tiles - first_tile + NUM_KV_SPLITS - 1) // NUM_KV_SPLITS
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    if tile_lo >= tile_hi:
        return  # a split past this sequence's end: the merge skips it

    rows = tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads of this kv head (+ padding)
    heads = kv_head * QUERIES_PER_KV + rows
    row_mask = rows < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM_PADDED)  # [Dp]
    dim_mask = dims < HEAD_DIM
    offs_n = tl.arange(0, TILE_N)  # [TILE_N]

    q = tl.load(
        query_ptr + seq * query_stride_seq + heads[:, None] * query_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_H, Dp]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)  # running sum of 2**(s - m_i)
    acc = tl.full([BLOCK_H, HEAD_DIM_PADDED], 0.0, dtype=tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    head_offset = kv_head * cache_stride_head
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n  # [TILE_N] KV positions
        pos_mask = (pos < seq_len) & (pos >= kv_lo)  # never a table entry before the window
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slots = block_ids * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_slot + head_offset  # [TILE_N]

        k_t = tl.load(
            k_cache_ptr + slots[None, :] + dims[:, None],
            mask=dim_mask[:, None] & pos_mask[None, :],
            other=0.0,
        )  # [Dp, TILE_N]
        s = scores_base2(tl.dot(q, k_t.to(DOT_DTYPE), input_precision=DOT_PRECISION),
                         qk_scale, softcap_in, softcap_out, HAS_SOFTCAP)  # [BLOCK_H, TILE_N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))

        # Every tile of the loop holds >= 1 valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, TILE_N]
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)

        v = tl.load(
            v_cache_ptr + slots[:, None] + dims[None, :],
            mask=pos_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [TILE_N, Dp]
        # p is rounded to the cache dtype for the tensor-core dot, as flash attention does.
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_KV_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        partial_row = (seq * num_heads + heads) * NUM_KV_SPLITS + split  # [BLOCK_H]
        tl.store(
            partial_out_ptr + partial_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
            acc / l_i[:, None],
            mask=out_mask,
        )
        tl.store(partial_lse_ptr + partial_row, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _merge_kv_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    partial_out_ptr,  # [num_seqs, num_heads, NUM_KV_SPLITS, HEAD_DIM_PADDED] fp32
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_KV_SPLITS] fp32, base 2
    seq_lens_ptr,  # [num_seqs] int32
    out_stride_seq,
    out_stride_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)

    # The same split geometry as the first kernel: which splits of this sequence have tiles.
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = (seq_len + TILE_N - 1) // TILE_N - window_start(seq_len, WINDOW) // TILE_N
    tiles_per_split = (num_tiles + NUM_KV_SPLITS - 1) // NUM_KV_SPLITS
    num_used_splits = (num_tiles + tiles_per_split - 1) // tiles_per_split

    splits = tl.arange(0, NUM_KV_SPLITS)  # [S]
    split_mask = splits < num_used_splits
    dims = tl.arange(0, HEAD_DIM_PADDED)  # [Dp]
    dim_mask = dims < HEAD_DIM
    partial_row = (seq * num_heads + head) * NUM_KV_SPLITS + splits  # [S]

    lse = tl.load(partial_lse_ptr + partial_row, mask=split_mask, other=float("-inf"))  # [S]
    weight = tl.exp2(lse - tl.reduce(lse, 0, _max_combine))  # [S]: 0 for unused splits (split 0 is used)
    partial = tl.load(
        partial_out_ptr + partial_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [S, Dp]
    out = tl.reduce(partial * weight[:, None], 0, _sum_combine) / tl.reduce(weight, 0, _sum_combine)  # [Dp]
    tl.store(
        out_ptr + seq * out_stride_seq + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K factor for a decode batch: a power of two in [1, MAX_KV_SPLITS].

    Without splitting there are ``num_seqs * num_kv_heads`` programs; split only as far as needed
    to reach ``PROGRAMS_PER_SM * num_sms`` of them, and only into splits of at least
    ``MIN_TOKENS_PER_SPLIT`` positions of the longest sequence. Large batches and short contexts
    get 1 (one kernel, no merge); a few long sequences get several.
    """
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / max(1, num_seqs * num_kv_heads))
    splits = min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_KV_SPLITS)
    if splits <= 1:
        return 1
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: parallelism buys nothing


def check_paged_decode_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim], got {tuple(query.shape)}")
    num_seqs, num_heads, head_dim = query.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches must both be [num_blocks, block_size, num_kv_heads, {head_dim}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (query.dtype == k_cache.dtype == v_cache.dtype) or query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query and caches must share one dtype of {SUPPORTED_DTYPES}, got "
                        f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("query and caches need a contiguous last dim, and the caches equal strides")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_num_blocks] with contiguous rows, "
                         f"got {tuple(block_tables.shape)}")
    if seq_lens.shape != (num_seqs,) or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError(f"block_tables and seq_lens must be int32, got {block_tables.dtype}, {seq_lens.dtype}")


def paged_decode_attention_triton(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, KV length including the new token (>= 1)
    max_seq_len: int,  # host copy of max(seq_lens), for the split heuristic (no device sync)
    scale: float,
    num_kv_splits: int | None = None,  # None: choose_num_kv_splits; 1: no split-K
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Launcher: checks the arguments, picks the split count, runs one or two kernels."""
    check_paged_decode_args(query, k_cache, v_cache, block_tables, seq_lens)
    interpreted = check_triton_launch(_paged_decode_kernel, query=query, k_cache=k_cache, v_cache=v_cache,
                                      block_tables=block_tables, seq_lens=seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    if num_kv_splits is None:
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + TILE_N)
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, span, _num_sms(query.device))
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")

    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if num_kv_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_kv_splits, head_dim_padded,
                                  dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_kv_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the kernel

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        out, partial_out, partial_lse, query, k_cache, v_cache, block_tables, seq_lens,
        scale * math.log2(math.e), scale / (softcap or 1.0), (softcap or 1.0) * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        NUM_KV_SPLITS=num_kv_splits,
        WINDOW=sliding_window or 0,
        HAS_SOFTCAP=softcap is not None,
        DOT_DTYPE=dot_operand_dtype(query.dtype, interpreted),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, seq_lens,
            out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            TILE_N=TILE_N,
            NUM_KV_SPLITS=num_kv_splits,
            WINDOW=sliding_window or 0,
            num_warps=4,
        )
    return out


def dot_operand_dtype(dtype: torch.dtype, interpreted: bool) -> tl.dtype:
    # Triton's interpreter computes bf16 tl.dot on the raw bit patterns (triton-lang/triton#11584):
    # there, the operands are widened to float32 after the same roundings the GPU would see.
    if interpreted:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,
    scale: float,
    num_kv_splits: int | None = None,  # accepted for the signature; splitting changes no result
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Reference: per sequence, gather its K/V in the window through the block table, dense
    float32 softmax."""
    check_paged_decode_args(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        first = 0 if sliding_window is None else max(0, seq_len - sliding_window)
        positions = torch.arange(first, seq_len, device=query.device)  # [L]
        slots = block_tables[i].long()[positions // block_size] * block_size + positions % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [L, Hkv, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i].float(), k) * scale  # [H, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out


paged_decode_attention_reference = paged_decode_attention_torch
