"""Tensor-parallel layers: one rank's shard of a projection, the embedding and the LM head.

A model split over N ranks (``ShardGroup``) keeps whole heads on each rank, so attention needs no
communication; only the projections that leave a rank's heads (or its slice of the MLP) sum
partial results:

    x (replicated) ─ qkv_proj  [column: this rank's H/N q heads, Hkv/N k and v heads]
                   ─ attention over this rank's heads (its own KV cache: Hkv/N heads)
                   ─ o_proj    [row: this rank's H/N * D input columns] ─ all-reduce ─> x'
    x' ─ gate_up_proj [column: I/N of each] ─ silu * up ─ down_proj [row: I/N columns] ─ all-reduce
       (a mixture-of-experts block: I/N of every expert's columns, the router replicated: models.moe)
    embed_tokens  [vocab rows V/N: ids outside the slice give zeros] ─ all-reduce
    lm_head       [vocab rows V/N] ─ gather to rank 0 ─> logits [T, V]

The vocabulary is padded up to a multiple of N (padding rows are zero and trimmed from the
gathered logits). A bias of a row-parallel projection is added once: rank 0 holds it, the others
hold zeros. Each layer reads only its slice of a checkpoint tensor (``checkpoint_slice``, given
safetensors' lazy slice), so no rank materialises a whole matrix.

The collectives run on the process group ``engine.parallel`` binds to the ``ShardGroup``; this
module owns no processes. With one rank the factories return the plain ``layers`` modules: the
single-device path has no collective and no extra copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from llmplatform.kernels.ops import ModelOps
from llmplatform.models.layers import Embedding, Linear


class Collectives(Protocol):
    """What the layers need from a process group (``engine.parallel.group`` implements it)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` over the ranks, in place."""

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape) on rank 0, in rank order; None on the others."""


class ShardGroup:
    """One rank's place in a tensor-parallel group; the layers built with it hold this rank's
    shard and call its collectives. ``bind`` attaches (or, after the other ranks were started
    again, replaces) the process group."""

    def __init__(self, rank: int, size: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank = rank
        self.size = size
        self._collectives: Collectives | None = None

    def bind(self, collectives: Collectives) -> None:
        self._collectives = collectives

    @property
    def collectives(self) -> Collectives:
        if self._collectives is None:
            raise RuntimeError("the tensor-parallel group has no process group bound")
        return self._collectives

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.collectives.all_reduce(tensor)
        return tensor

    def split(self, count: int, what: str) -> int:
        """This rank's share of ``count`` (heads, columns), which must divide evenly."""
        if count % self.size:
            raise ValueError(f"{what} ({count}) do not divide by --tensor-parallel-size {self.size}")
        return count // self.size

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """(first id, end id, padded rows per rank) of this rank's slice of the vocabulary."""
        per_rank = -(-vocab_size // self.size)
        start = min(vocab_size, self.rank * per_rank)
        return start, min(vocab_size, start + per_rank), per_rank


def check_divisible(config: Any, size: int) -> None:
    """Raises ValueError naming the counts when ``size`` ranks cannot each hold whole heads, whole
    key/value heads and an equal slice of the MLP (checked before any rank is started)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    counts = [(heads, "attention heads"), (kv_heads, "key/value heads"),
              (config.intermediate_size, "MLP columns (intermediate_size)")]
    if getattr(config, "moe_intermediate_size", None):  # Qwen3-MoE's experts (models.moe)
        counts.append((config.moe_intermediate_size, "expert columns (moe_intermediate_size)"))
    problems = [f"{count} {what}" for count, what in counts if count % size]
    if problems:
        fitting = [n for n in range(1, kv_heads + 1) if not any(count % n for count, _ in counts)]
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide this model's {' and '.join(problems)}: "
            f"each rank holds whole heads and an equal share of the MLP (sizes that fit: "
            f"{', '.join(map(str, fitting))})")


# ---- layers ------------------------------------------------------------------------------------


class ColumnParallelLinear(Linear):
    """A (fused) projection split along its outputs: each of ``full_output_sizes`` (q, k, v or
    gate, up) contributes its rank-th 1/N rows, so this rank's output is its own heads' q, k, v
    side by side, the layout the attention code expects of the unsplit projection."""

    def __init__(self, in_features: int, full_output_sizes: Sequence[int], group: ShardGroup, *,
                 bias: bool, dtype: torch.dtype, device: torch.device | str,
                 ops: ModelOps | None = None) -> None:
        local = [group.split(size, "projection rows") for size in full_output_sizes]
        super().__init__(in_features, local, bias=bias, dtype=dtype, device=device, ops=ops)
        self.group = group

    def checkpoint_slice(self, kind: str, shard: int, lazy: Any) -> torch.Tensor:
        rows = self.output_sizes[shard]
        start = self.group.rank * rows
        return lazy[start:start + rows]  # weight [rows, in] or bias [rows]


class RowParallelLinear(Linear):
    """A projection split along its inputs (o_proj over this rank's heads, down_proj over its
    MLP slice): partial products, summed over the ranks."""

    def __init__(self, full_in_features: int, out_features: int, group: ShardGroup, *, bias: bool,
                 dtype: torch.dtype, device: torch.device | str, ops: ModelOps | None = None) -> None:
        super().__init__(group.split(full_in_features, "projection columns"), [out_features],
                         bias=bias, dtype=dtype, device=device, ops=ops)
        self.group = group
        self.in_features = full_in_features // group.size

    def checkpoint_slice(self, kind: str, shard: int, lazy: Any) -> torch.Tensor:
        if kind == "bias":  # added once, by rank 0: the others add zeros
            return lazy[:] if self.group.rank == 0 else torch.zeros(lazy.get_shape())
        start = self.group.rank * self.in_features
        return lazy[:, start:start + self.in_features]  # [out, in / N]

    def forward(self, x: torch.Tensor,  # [T, in / N]
                out_dtype: torch.dtype | None = None) -> torch.Tensor:  # [T, out], summed
        return self.group.all_reduce(super().forward(x, out_dtype))


def _vocab_rows(group: ShardGroup, vocab_size: int, lazy: Any) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] checkpoint matrix, zero-padded to the shard size."""
    start, end, per_rank = group.vocab_range(vocab_size)
    rows = lazy[start:end]  # [end - start, hidden]
    if end - start == per_rank:
        return rows
    padding = torch.zeros((per_rank - (end - start), *rows.shape[1:]), dtype=rows.dtype)
    return torch.cat([rows, padding])


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the embedding matrix; a token outside them looks up zeros, and the
    all-reduce assembles every token's row (x + 0 is exact: the result equals one device's)."""

    def __init__(self, vocab_size: int, dim: int, group: ShardGroup, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        start, end, per_rank = group.vocab_range(vocab_size)
        super().__init__(per_rank, dim, dtype=dtype, device=device)
        self.vocab_size, self.group, self.start, self.end = vocab_size, group, start, end

    def checkpoint_slice(self, kind: str, shard: int, lazy: Any) -> torch.Tensor:
        return _vocab_rows(self.group, self.vocab_size, lazy)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        outside = (ids < self.start) | (ids >= self.end)  # [T]
        local_ids = (ids - self.start).masked_fill_(outside, 0)  # [T]
        x = F.embedding(local_ids, self.weight).masked_fill_(outside.unsqueeze(-1), 0)  # [T, dim]
        return self.group.all_reduce(x)


class VocabParallelLMHead(Linear):
    """This rank's rows of the output projection (its slice of the logits); the model gathers
    the slices on rank 0 (``gather_logits``)."""

    def __init__(self, hidden_size: int, vocab_size: int, group: ShardGroup, *,
                 dtype: torch.dtype, device: torch.device | str, ops: ModelOps | None = None) -> None:
        super().__init__(hidden_size, [group.vocab_range(vocab_size)[2]], bias=False, dtype=dtype,
                         device=device, ops=ops, prepack=False)
        self.vocab_size, self.group = vocab_size, group

    def checkpoint_slice(self, kind: str, shard: int, lazy: Any) -> torch.Tensor:
        return _vocab_rows(self.group, self.vocab_size, lazy)


def gather_logits(group: ShardGroup, local: torch.Tensor,  # [N, V / ranks] (padded)
                  vocab_size: int) -> torch.Tensor:  # rank 0: [N, V]; the others: ``local``
    """Every rank's slice of the logits, in vocabulary order, on rank 0 (padding rows dropped).
    The other ranks' return value is their own slice (nobody samples there)."""
    parts = group.collectives.gather_to_first(local.contiguous())
    if parts is None:
        return local
    return torch.cat(parts, dim=-1)[:, :vocab_size]


# ---- factories: the plain layers with one rank -------------------------------------------------


def column_linear(group: ShardGroup | None, in_features: int, output_sizes: Sequence[int], *,
                  bias: bool, dtype: torch.dtype, device: torch.device | str,
                  ops: ModelOps | None = None) -> Linear:
    if group is None or group.size == 1:
        return Linear(in_features, output_sizes, bias=bias, dtype=dtype, device=device, ops=ops)
    return ColumnParallelLinear(in_features, output_sizes, group, bias=bias, dtype=dtype, device=device, ops=ops)


def row_linear(group: ShardGroup | None, in_features: int, out_features: int, *, bias: bool,
               dtype: torch.dtype, device: torch.device | str, ops: ModelOps | None = None) -> Linear:
    if group is None or group.size == 1:
        return Linear(in_features, [out_features], bias=bias, dtype=dtype, device=device, ops=ops)
    return RowParallelLinear(in_features, out_features, group, bias=bias, dtype=dtype, device=device, ops=ops)


def vocab_embedding(group: ShardGroup | None, vocab_size: int, dim: int, *, dtype: torch.dtype,
                    device: torch.device | str) -> Embedding:
    if group is None or group.size == 1:
        return Embedding(vocab_size, dim, dtype=dtype, device=device)
    return VocabParallelEmbedding(vocab_size, dim, group, dtype=dtype, device=device)


def lm_head_linear(group: ShardGroup | None, hidden_size: int, vocab_size: int, *,
                   dtype: torch.dtype, device: torch.device | str, ops: ModelOps | None = None) -> Linear:
    """The output projection of an untied model (not prepacked: see ``Linear``)."""
    if group is None or group.size == 1:
        return Linear(hidden_size, [vocab_size], bias=False, dtype=dtype, device=device, ops=ops, prepack=False)
    return VocabParallelLMHead(hidden_size, vocab_size, group, dtype=dtype, device=device, ops=ops)
