"""paged_attention: causal attention of new tokens over their sequence's paged KV cache.

One call serves every batch shape: prefill, chunked prefill (cached context plus several new
tokens), decode (one new token per sequence) and any mix. Query i of sequence s sits at position
``p = context_lens[s] + i`` and may attend to cache positions ``0 .. p``, or with a
``sliding_window`` W only to ``p - W < j <= p`` (W keys, itself included: transformers'
convention). With ``softcap`` c the scores are ``c * tanh(q.k * scale / c)`` before masking and
softmax (Gemma 2). The new tokens' K/V are already in the cache (``store_kv_cache`` runs first),
so a reference can read everything from the cache. Under a window, table entries of blocks wholly
before it are never read: the engine frees those blocks (their entries then name a placeholder or
a block another sequence reuses), and skipping them is where windowed attention saves its time.

The torch path below is what CPU serving runs, so it is built for speed, not only for clarity.
Both halves use torch's fused ``scaled_dot_product_attention`` (a flash-style CPU kernel that
accumulates in float32, never materializes the whole score matrix and is vectorized for bf16 as
well as fp32); on the 2-core AVX-512 CPU without bf16 instructions it measured 2-4x faster than
explicit batched matmuls + softmax (``benchmarks/attention_micro.py``):

- Decode rows (query length 1) of all sequences go through one batched call. Per step (not per
  layer) the sequences are sorted by length and cut into a few buckets, so short sequences are not
  padded to the longest one. Per bucket and layer: one gather of whole K blocks and one of V
  blocks from the cache into a reused workspace ([n, kv_len, kv_heads, D] token-major, the fastest
  copy there is), then one fused call in which GQA costs nothing: the q_per_kv query heads that
  share a kv head are laid out as that kv head's "query positions" ([n, kv_heads, q_per_kv, D])
  over the workspace viewed [n, kv_heads, kv_len, D] (a strided view, no copy, no repeat of K/V),
  with an additive -inf mask past each sequence's length. Decode is memory bound (each layer
  reads every sequence's K/V once), so fewer bytes moved beats fewer FLOPs.
- Rows of a sequence with several new tokens are attended per sequence, over the new K/V directly
  when nothing is cached (plain ``is_causal``), else over the sequence's K/V gathered from the
  cache with a causal mask offset by the context length; GQA as a stride-0 expand of K/V
  (``enable_gqa`` is orders of magnitude slower on CPU and ``repeat_interleave`` copies).

With ``softcap`` both halves run the same gathers and masks through explicit float32 matmuls and
softmax instead (SDPA has no soft-capping).

Everything that depends only on the metadata and the window (index tensors, masks, buckets,
workspaces) is built once, on the first layer's call, and kept in ``metadata.derived`` for the
other layers (per window: interleaved models have layers with and without one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmplatform.kernels.metadata import AttentionMetadata

# Fixed cost of one more decode bucket (a handful of extra op launches), expressed in padded
# (sequence, KV position) pairs of work; splitting pays off when it removes more padding than
# this. On the 2-core CPU with SmolLM2's shapes, values from 512 to 2048 measure the same
# (benchmarks/attention_micro.py).
_BUCKET_OVERHEAD_TOKENS = 2048
# At most this many sequences per decode bucket (bounds the bucketing search; measured neutral
# for speed between 16 and 64).
_MAX_BUCKET_SEQS = 64


def check_paged_attention_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Shape/dtype checks shared by every implementation (the launcher's half)."""
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"query must be [T, H, D] and key/value [T, Hkv, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (query.dtype == key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError("query, key, value and the caches must share one dtype")
    if metadata.num_tokens != num_tokens:
        raise ValueError(f"metadata describes {metadata.num_tokens} tokens, query has {num_tokens}")


@dataclass
class _DecodeBucket:
    """Decode sequences of similar length, attended together.

    ``kv_index`` holds, per sequence, the ids of ``kv_len // block_size`` blocks starting at its
    first block inside the window (its block 0 without one); K/V land in the workspaces as
    [n, kv_len, kv_heads, D].
    """

    rows: torch.Tensor | None  # [n] token rows of the batch; None: all rows, in order
    kv_index: torch.Tensor  # [n * kv_len // block_size] block ids
    mask: torch.Tensor  # [n, 1, 1, kv_len] additive: 0 where the key is visible, -inf elsewhere
    k_buffer: torch.Tensor  # [n * kv_len * kv_heads * D] gather workspace, reused by every layer
    v_buffer: torch.Tensor  # same
    num_seqs: int
    kv_len: int


@dataclass
class _PrefillSeq:
    """A sequence with several new tokens."""

    start: int  # its first token row
    end: int
    kv_slots: torch.Tensor | None  # [kv_len] cache slots of the keys it may see; None: no cached prefix
    allowed: torch.Tensor | None  # [q_len, kv_len] True = may attend; None: plain causal over new K/V


@dataclass
class _KernelDecode:
    """All decode sequences of the step, for a decode kernel that reads the paged cache itself."""

    rows: torch.Tensor | None  # [n] token rows of the batch; None: all rows, in order
    block_tables: torch.Tensor  # [n, max_num_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int32, contiguous


@dataclass
class _Plan:
    decode_buckets: list[_DecodeBucket]  # empty when a decode kernel does the decode rows
    prefills: list[_PrefillSeq]
    kernel_decode: _KernelDecode | None = None


DecodeKernel = Callable[..., torch.Tensor]
"""(query [n, H, D], k_cache, v_cache, block_tables [n, B] int32, seq_lens [n] int32, scale, *,
sliding_window, softcap) -> [n, H, D]: attention of one new token per sequence over its paged
cache."""


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (already stored in the cache)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    decode_kernel: DecodeKernel | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """With ``decode_kernel`` (the CPU C kernel, ``cpu_decode.py``), the decode rows go to it in
    one call instead of the gather + fused-attention buckets below; prefill rows are unchanged."""
    plan = _get_plan(metadata, k_cache, query.dtype, kernel_decode=decode_kernel is not None,
                     sliding_window=sliding_window)

    if plan.kernel_decode is not None:
        kd = plan.kernel_decode
        decoded = decode_kernel(query if kd.rows is None else query.index_select(0, kd.rows),
                                k_cache, v_cache, kd.block_tables, kd.seq_lens, scale,
                                sliding_window=sliding_window, softcap=softcap)  # [n, H, D]
        if kd.rows is None:
            return decoded  # a decode-only batch
        out = torch.empty_like(query)
        out.index_copy_(0, kd.rows, decoded)
        for seq in plan.prefills:
            _prefill(query, key, value, k_cache, v_cache, seq, scale, softcap, out)
        return out

    buckets = plan.decode_buckets
    if not plan.prefills and len(buckets) == 1 and buckets[0].rows is None:
        return _decode(query, k_cache, v_cache, buckets[0], scale, softcap)  # the whole batch is one bucket

    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    for bucket in buckets:
        rows = bucket.rows
        bucket_query = query if rows is None else query.index_select(0, rows)  # [n, num_heads, head_dim]
        bucket_out = _decode(bucket_query, k_cache, v_cache, bucket, scale, softcap)  # [n, num_heads, head_dim]
        if rows is None:
            out.copy_(bucket_out)
        else:
            out.index_copy_(0, rows, bucket_out)
    for seq in plan.prefills:
        _prefill(query, key, value, k_cache, v_cache, seq, scale, softcap, out)
    return out


def _decode(
    query: torch.Tensor,  # [n, H, D], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    bucket: _DecodeBucket,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [n, H, D]
    n, H, D = query.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    G = H // Hkv  # query heads per kv head; head h reads kv head h // G
    L = bucket.kv_len
    k = torch.index_select(k_cache.view(num_blocks, -1), 0, bucket.kv_index,
                           out=bucket.k_buffer.view(-1, block_size * Hkv * D))
    v = torch.index_select(v_cache.view(num_blocks, -1), 0, bucket.kv_index,
                           out=bucket.v_buffer.view(-1, block_size * Hkv * D))
    k = k.view(n, L, Hkv, D).transpose(1, 2)  # [n, Hkv, L, D] strided view of the workspace
    v = v.view(n, L, Hkv, D).transpose(1, 2)  # [n, Hkv, L, D]
    # The G query heads of kv head j act as G query positions over j's keys: exact for decode,
    # where the G heads see the same keys (the mask cuts the padding and what is outside the window).
    q = query.view(n, Hkv, G, D)  # [n, Hkv, G, D]
    out = _attend(q, k, v, bucket.mask, scale, softcap)  # [n, Hkv, G, D]
    return out.reshape(n, H, D)


def _prefill(
    query: torch.Tensor,  # [num_tokens, H, D]
    key: torch.Tensor,  # [num_tokens, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    seq: _PrefillSeq,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,  # [num_tokens, H, D], rows start..end written here
) -> None:
    H, D = query.shape[1:]
    Hkv = key.shape[1]
    G = H // Hkv  # query heads per kv head
    n = seq.end - seq.start  # q_len
    if seq.kv_slots is None:  # nothing cached: the new K/V are the whole sequence
        k = key[seq.start:seq.end]  # [L, Hkv, D]
        v = value[seq.start:seq.end]  # [L, Hkv, D]
    else:
        k = k_cache.view(-1, Hkv, D).index_select(0, seq.kv_slots)  # [L, Hkv, D]
        v = v_cache.view(-1, Hkv, D).index_select(0, seq.kv_slots)  # [L, Hkv, D]
    L = k.shape[0]  # kv_len
    q = query[seq.start:seq.end].view(n, Hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    k = k.permute(1, 0, 2).unsqueeze(1).expand(Hkv, G, L, D)  # [Hkv, G, L, D] stride-0 GQA
    v = v.permute(1, 0, 2).unsqueeze(1).expand(Hkv, G, L, D)
    if softcap is None:
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seq.allowed, is_causal=seq.allowed is None, scale=scale
        )  # [Hkv, G, n, D]
    else:
        allowed = seq.allowed if seq.allowed is not None else torch.ones(
            n, L, dtype=torch.bool, device=q.device).tril_()
        attn = _attend(q, k, v, allowed, scale, softcap)  # [Hkv, G, n, D]
    out[seq.start:seq.end].view(n, Hkv, G, D).copy_(attn.permute(2, 0, 1, 3))


def _attend(
    q: torch.Tensor,  # [..., n, D]
    k: torch.Tensor,  # [..., L, D]
    v: torch.Tensor,  # [..., L, D]
    mask: torch.Tensor,  # broadcastable to [..., n, L]: bool (True = may attend) or additive
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [..., n, D] in q's dtype
    """Attention with a mask: torch's fused kernel, or with ``softcap`` explicit float32 matmuls
    (the scores are capped before the mask and the softmax, as Gemma 2 does)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale / softcap).tanh_().mul_(softcap)
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    else:
        scores.add_(mask)
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The per-step plan


def _get_plan(metadata: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype, *,
              kernel_decode: bool, sliding_window: int | None) -> _Plan:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    key = ("paged_attention_torch", block_size, num_kv_heads, head_dim, dtype, k_cache.device, kernel_decode,
           sliding_window)
    plan = metadata.derived.get(key)
    if plan is None:
        plan = _build_plan(metadata, block_size, num_kv_heads, head_dim, dtype, k_cache.device,
                           kernel_decode=kernel_decode, window=sliding_window)
        metadata.derived[key] = plan
    return plan


def _build_plan(
    metadata: AttentionMetadata,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    kernel_decode: bool,
    window: int | None,
) -> _Plan:
    starts = metadata.query_start_loc_cpu
    seq_lens = metadata.seq_lens_cpu
    decode_ids = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    prefill_ids = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] > 1]
    prefills = _prefill_plans(metadata, prefill_ids, block_size, device, window)

    if kernel_decode:
        if not decode_ids:
            return _Plan(decode_buckets=[], prefills=prefills)
        if not prefill_ids:  # every row is a decode row, in order
            rows, block_tables, lens = None, metadata.block_tables, metadata.seq_lens
        else:
            ids = torch.tensor(decode_ids, dtype=torch.int64, device=device)
            rows = torch.tensor([starts[i] for i in decode_ids], dtype=torch.int64, device=device)
            block_tables, lens = metadata.block_tables.index_select(0, ids), metadata.seq_lens.index_select(0, ids)
        kd = _KernelDecode(rows, block_tables.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous())
        return _Plan(decode_buckets=[], prefills=prefills, kernel_decode=kd)

    # A decode row reads its blocks from the first one inside the window: bucket by that span.
    first_blocks = {i: _first_block(seq_lens[i] - 1, window, block_size) for i in decode_ids}
    spans = {i: seq_lens[i] - first_blocks[i] * block_size for i in decode_ids}
    buckets: list[_DecodeBucket] = []
    groups = _bucket_by_length(sorted(decode_ids, key=lambda i: spans[i]), spans)
    all_rows_in_order = len(groups) == 1 and not prefill_ids
    if all_rows_in_order:
        groups = [decode_ids]  # one bucket: keep batch order, so its output needs no scatter
    for group in groups:
        if all_rows_in_order:
            rows = None
        else:
            rows = torch.tensor([starts[i] for i in group], dtype=torch.int64, device=device)
        buckets.append(_decode_bucket(metadata, group, rows, [first_blocks[i] for i in group], window,
                                      block_size, num_kv_heads, head_dim, dtype, device))
    return _Plan(decode_buckets=buckets, prefills=prefills)


def _first_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at ``position`` may see a key in."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def _prefill_plans(metadata: AttentionMetadata, prefill_ids: list[int], block_size: int,
                   device: torch.device, window: int | None) -> list[_PrefillSeq]:
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    prefills = []
    for i in prefill_ids:
        context_len, kv_len = metadata.context_lens_cpu[i], seq_lens[i]
        start, end = starts[i], starts[i + 1]
        windowed = window is not None and window < kv_len
        if context_len == 0 and not windowed:
            prefills.append(_PrefillSeq(start, end, kv_slots=None, allowed=None))
            continue
        # Keys from the first the first query may see (position context_len): earlier ones are
        # outside every query's window, and their blocks may be gone.
        kv_start = max(0, context_len - window + 1) if windowed else 0
        q_pos = torch.arange(context_len, kv_len, device=device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(kv_start, kv_len, device=device)[None, :]  # [1, L]
        allowed = k_pos <= q_pos
        if windowed:
            allowed &= k_pos > q_pos - window
        if context_len == 0:  # nothing cached: attend over the new K/V
            prefills.append(_PrefillSeq(start, end, kv_slots=None, allowed=allowed))
            continue
        table = metadata.block_tables[i].long()  # [max_num_blocks]
        positions = k_pos[0]  # [L]
        kv_slots = table[positions // block_size] * block_size + positions % block_size  # [L]
        prefills.append(_PrefillSeq(start, end, kv_slots, allowed))
    return prefills


def _decode_bucket(
    metadata: AttentionMetadata,
    seq_ids: list[int],
    rows: torch.Tensor | None,
    first_blocks: list[int],  # per sequence, the first block its query may see
    window: int | None,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> _DecodeBucket:
    n = len(seq_ids)
    lens = metadata.seq_lens_cpu
    num_blocks = max(-(-lens[i] // block_size) - first for i, first in zip(seq_ids, first_blocks))
    kv_len = num_blocks * block_size
    ids = torch.tensor(seq_ids, dtype=torch.int64, device=device)  # [n]
    tables = metadata.block_tables.index_select(0, ids).long()  # [n, max_num_blocks]
    first = torch.tensor(first_blocks, dtype=torch.int64, device=device)  # [n]
    last = torch.tensor([-(-lens[i] // block_size) - 1 for i in seq_ids], dtype=torch.int64, device=device)
    columns = first[:, None] + torch.arange(num_blocks, device=device)[None, :]  # [n, num_blocks]
    # Columns past a short sequence's end read its own last block again (the mask hides them):
    # never a block of someone else, whose content may be anything, NaN included.
    columns = torch.minimum(columns, last[:, None])
    kv_index = tables.gather(1, columns).reshape(-1)  # [n * num_blocks] block ids
    seq_lens = metadata.seq_lens.index_select(0, ids)  # [n]
    positions = first[:, None] * block_size + torch.arange(kv_len, device=device)[None, :]  # [n, kv_len]
    hidden = positions >= seq_lens[:, None]  # past the end
    if window is not None:
        hidden |= positions <= seq_lens[:, None] - 1 - window  # before the window
    mask = torch.zeros(n, kv_len, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    numel = n * kv_len * num_kv_heads * head_dim
    return _DecodeBucket(
        rows=rows,
        kv_index=kv_index,
        mask=mask.view(n, 1, 1, kv_len),
        k_buffer=torch.empty(numel, dtype=dtype, device=device),
        v_buffer=torch.empty(numel, dtype=dtype, device=device),
        num_seqs=n,
        kv_len=kv_len,
    )


def _bucket_by_length(seq_ids: list[int], seq_lens: dict[int, int]) -> list[list[int]]:
    """Cut sequences, sorted by length (the span of keys each reads), into contiguous groups
    minimizing padded work.

    Cost of a group = its size * its longest length + a fixed per-group overhead; an exact
    O(n^2) dynamic program over the cut points (n <= a few hundred, once per step).
    """
    n = len(seq_ids)
    if n == 0:
        return []
    lens = [seq_lens[i] for i in seq_ids]
    best = [0.0] + [float("inf")] * n  # best[i]: cost of the first i sequences
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        longest = lens[i - 1]
        for j in range(max(0, i - _MAX_BUCKET_SEQS), i):
            cost = best[j] + _BUCKET_OVERHEAD_TOKENS + (i - j) * longest
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups = []
    i = n
    while i > 0:
        groups.append(seq_ids[cut[i]:i])
        i = cut[i]
    return groups[::-1]
