"""Paged prefill attention in Triton: variable-length query blocks over a cached prefix + themselves.

The batch's new tokens are flattened, sequence after sequence (``cu_seqlens_q``). Sequence s has
``q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s]`` new tokens at positions
``context_len .. seq_len - 1`` (``context_len = seq_len - q_len`` tokens were cached before this
step: a chunked prefill's earlier chunks, a prefix-cache hit, or the whole history of a decode
row). Their K/V are already in the cache, so every key is read through the block table.
Query at position p may see keys 0 .. p:

              keys:  0 ............ context_len-1 | context_len ........ seq_len-1
    query row i   :  all cached (prefix)          | new keys up to context_len + i

Work split: ``grid = (num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads)``. One program takes
BLOCK_Q consecutive new tokens of one sequence and all ``queries_per_kv`` query heads of one kv
head, flattened into BLOCK_M = BLOCK_Q * QUERIES_PER_KV_PADDED rows (row r: token r // G_pad,
head r % G_pad), so each K/V tile is loaded once for the whole group (GQA). Programs past their
sequence's end exit at once. Keys are walked in TILE_N-position tiles up to the last query's
position; a tile's positions are gathered through the block table one by one, so any block size
works. Rows are padding when their token is past q_len or their head past queries_per_kv: they
are computed on zero queries (always finite: key 0 is visible to every row) and never stored.

With a sliding window W (``WINDOW`` > 0) a query at p sees keys ``p - W < j <= p``; the key
tiles start at the one holding the first key the block's first query sees, so blocks before it are
never read (the engine may have freed them). Soft-capping as in the decode kernel.

Softmax: online, float32, base 2, as in the decode kernel. ``paged_prefill_attention_torch`` is
the reference with the launcher's signature.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmplatform.kernels import check_triton_launch
from llmplatform.kernels.triton_decode_attention import SUPPORTED_DTYPES, dot_operand_dtype, scores_base2

# Rows per program (query tokens x query heads of one kv head) when the queries are long enough.
BLOCK_M = 64
# KV positions per inner-loop tile.
TILE_N = 32
# tl.max / tl.sum as builtin reductions: see the note in triton_decode_attention.
_max_combine = tl.standard._elementwise_max
_sum_combine = tl.standard._sum_combine


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    query_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    softcap_in,  # scale / softcap (HAS_SOFTCAP only)
    softcap_out,  # softcap * log2(e) (HAS_SOFTCAP only)
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_block,  # k_cache and v_cache share strides (checked by the launcher)
    cache_stride_slot,
    cache_stride_head,
    block_tables_stride,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window; 0: none
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the cache dtype; float32 under the interpreter (no bf16 tl.dot there)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no tf32 rounding
):
    BLOCK_M: tl.constexpr = BLOCK_Q * QUERIES_PER_KV_PADDED
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_token = q_block * BLOCK_Q  # index among this sequence's new tokens
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tokens = first_token + rows // QUERIES_PER_KV_PADDED  # [BLOCK_M] new-token index
    group = rows % QUERIES_PER_KV_PADDED
    heads = kv_head * QUERIES_PER_KV + group
    row_mask = (tokens < q_len) & (group < QUERIES_PER_KV)
    q_pos = context_len + tokens  # [BLOCK_M] the query's position in its sequence
    dims = tl.arange(0, HEAD_DIM_PADDED)  # [Dp]
    dim_mask = dims < HEAD_DIM
    offs_n = tl.arange(0, TILE_N)

    token_rows = (q_start + tokens).to(tl.int64)
    q = tl.load(
        query_ptr + token_rows[:, None] * query_stride_token + heads[:, None] * query_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, Dp]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base 2)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)  # running sum of 2**(s - m_i)
    acc = tl.full([BLOCK_M, HEAD_DIM_PADDED], 0.0, dtype=tl.float32)

    # Keys past the block's last query are invisible to all its rows.
    kv_end = tl.minimum(context_len + first_token + BLOCK_Q, seq_len)
    # Keys before the block's first query's window are invisible to all its rows.
    kv_lo = context_len + first_token - WINDOW + 1 if WINDOW > 0 else 0
    kv_lo = tl.maximum(kv_lo, 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    head_offset = kv_head * cache_stride_head
    for tile in range(kv_lo // TILE_N, (kv_end + TILE_N - 1) // TILE_N):
        pos = tile * TILE_N + offs_n  # [TILE_N] KV positions
        pos_mask = (pos < kv_end) & (pos >= kv_lo)  # never a table entry before the window
        block_ids = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        slots = block_ids * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_slot + head_offset  # [TILE_N]

        k_t = tl.load(
            k_cache_ptr + slots[None, :] + dims[:, None],
            mask=dim_mask[:, None] & pos_mask[None, :],
            other=0.0,
        )  # [Dp, TILE_N]
        s = scores_base2(tl.dot(q, k_t.to(DOT_DTYPE), input_precision=DOT_PRECISION),
                         qk_scale, softcap_in, softcap_out, HAS_SOFTCAP)  # [BLOCK_M, TILE_N]
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # causal, offset by the context
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))

        # Without a window, position 0 is in tile 0 and visible to every row, so m_new is finite
        # from tile 0 on; with one, a row may see nothing in its first tiles: its max stays -inf
        # and is taken as 0 there, so that p and alpha are 0, not NaN.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # [BLOCK_M]
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)

        v = tl.load(
            v_cache_ptr + slots[:, None] + dims[None, :],
            mask=pos_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [TILE_N, Dp]
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # 0 only on padding rows that see no key
    tl.store(
        out_ptr + token_rows[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def check_paged_prefill_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1:]
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
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 1 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous [num_seqs >= 1], got {tuple(seq_lens.shape)}")
    if cu_seqlens_q.shape != (num_seqs + 1,) or not cu_seqlens_q.is_contiguous():
        raise ValueError(f"cu_seqlens_q must be a contiguous [num_seqs + 1 = {num_seqs + 1}], "
                         f"got {tuple(cu_seqlens_q.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_num_blocks] with contiguous rows, "
                         f"got {tuple(block_tables.shape)}")
    if not (block_tables.dtype == cu_seqlens_q.dtype == seq_lens.dtype == torch.int32):
        raise TypeError(f"block_tables, cu_seqlens_q and seq_lens must be int32, got "
                        f"{block_tables.dtype}, {cu_seqlens_q.dtype}, {seq_lens.dtype}")


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], the new tokens of all sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, where each sequence's new tokens start
    seq_lens: torch.Tensor,  # [num_seqs] int32, KV length after this step (cached + new)
    max_query_len: int,  # host copy of the longest q_len: sizes the grid without a device sync
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Launcher: checks the arguments, sizes the query blocks, runs the kernel."""
    check_paged_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    interpreted = check_triton_launch(_paged_prefill_kernel, query=query, k_cache=k_cache, v_cache=v_cache,
                                      block_tables=block_tables, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")

    queries_per_kv = num_heads // num_kv_heads
    queries_per_kv_padded = triton.next_power_of_2(queries_per_kv)
    # BLOCK_Q tokens x the padded group fill BLOCK_M rows; short queries (decode rows of a mixed
    # batch) shrink the block so that fewer rows are padding, down to the 16 rows of a tl.dot.
    block_q = max(1, BLOCK_M // queries_per_kv_padded)
    block_q = min(block_q, triton.next_power_of_2(max_query_len))
    block_q = max(block_q, 16 // min(16, queries_per_kv_padded))
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
        scale * math.log2(math.e), scale / (softcap or 1.0), (softcap or 1.0) * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PADDED=queries_per_kv_padded,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        WINDOW=sliding_window or 0,
        HAS_SOFTCAP=softcap is not None,
        DOT_DTYPE=dot_operand_dtype(query.dtype, interpreted),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def paged_prefill_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Reference: per sequence, gather its K/V through the block table (from the first key its
    first query may see), dense float32 causal softmax with the mask offset by the cached context
    and cut to the window."""
    check_paged_prefill_args(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    starts = cu_seqlens_q.tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        first = 0 if sliding_window is None else max(0, context_len - sliding_window + 1)
        positions = torch.arange(first, seq_len, device=query.device)  # [L]
        slots = block_tables[i].long()[positions // block_size] * block_size + positions % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [L, Hkv, D]
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[starts[i]:starts[i + 1]].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale  # [H, q_len, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(context_len, seq_len, device=query.device)[:, None]  # [q_len, 1]
        visible = positions[None, :] <= q_pos
        if sliding_window is not None:
            visible &= positions[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


paged_prefill_attention_reference = paged_prefill_attention_torch
