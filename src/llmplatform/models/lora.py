"""LoRA on the model's projections: resident adapter slots and the batched (segmented) product.

A projection with LoRA computes ``y = x W^T + scaling * (x A^T) B^T`` with the adapter's low-rank
``A`` [r, in] and ``B`` [out, r]. Many adapters serve in one batch (S-LoRA, vLLM's punica): each
wrapped projection (:class:`LoRALinear`) holds ``max_loras`` *slots* of stacked weights, and a
step's rows are grouped by the slot of their adapter (rows of the base model are in no group).
Each group costs one pair of small products over its rows, gathered by index and added back:

    rows by slot:   | slot 2: rows 0, 3 | slot 0: rows 1, 4, 5 | base: row 2 (nothing added) |
    per group g:    y[rows_g] += ((x[rows_g] A_g^T) B_g^T)           (scaling folded into B_g)

so a step's LoRA cost is a loop over the adapters present (at most ``max_loras``), never over rows.
Small groups (decode rows: a few rows per adapter) make that loop's per-call overhead the cost,
so they run together: padded to the largest small group's size G, one batched product pair over
all of them (``LoRASmallGroups``: [groups, G, in] @ [groups, in, S * R] @ [groups, S * R, out];
padding rows read a zero row and add zeros). Large groups (prefill chunks) keep their own pair,
where padding them would multiply the waste.

Fused projections (``qkv_proj``, ``gate_up_proj``) have one (A, B) per slice (q, k, v; gate, up):
the slices' A are stacked along the rank, ``A_slots`` [L, S * R, in] (slice s at rows
``s * R ..``), and their B are block-diagonal, ``B_slots`` [L, out, S * R] (slice s's output rows
read only its own rank columns), so a fused projection also costs one shrink and one expand per
group (the zero blocks cost S times the expand's few multiplications, and spare S - 1 calls;
``LoRALinear`` holds them as ``lora_a`` = A_slots and ``lora_b_t`` = B_slots transposed):

    A_slots[l]:  [ A_q ]        B_slots[l]:  [ B_q  0    0   ]   q rows
                 [ A_k ]                     [ 0    B_k  0   ]   k rows
                 [ A_v ]                     [ 0    0    B_v ]   v rows

Ranks below ``max_lora_rank`` are zero-padded (zero rows of A and columns of B add nothing). A
slot an adapter leaves no weights in for a target (the adapter does not adapt it) holds zeros.

On a CPU where the C kernels build (the fused decode path: ``ModelOps.lora``), every group runs
in one call of ``kernels.cpu_lora`` instead (``LoRABatch.segments``): each slot's weights are read
once per step and widened in registers, so the slots keep the model's dtype (bf16 weights stream
half the bytes) and the zero blocks of ``B_slots`` are never read.

Under tensor parallelism (``models.parallel``) each rank's slots hold its share of an adapter, cut
the way the projection's weight is (``LoRALinear.shard``):

    column-parallel (qkv_proj, gate_up_proj): x is whole on every rank; each rank keeps the whole
        A and, per slice, the output rows of B its weight has (its q heads, its k/v heads, its
        gate/up columns), so its delta is exactly its rows of the whole delta;
    row-parallel (o_proj, down_proj): x is the rank's input columns; each rank keeps those columns
        of A and the whole B, and adds x_r A_r^T B^T to its partial product BEFORE the all-reduce
        (``RowParallelLoRALinear``): the sum over ranks is x A^T B^T, the whole delta.

Which rows use which slot is the step's forward-pass metadata: the model runner sets it for one
forward pass with :func:`lora_batch` (a scoped context that refuses nesting, not a module global
left behind).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from llmplatform.kernels.cpu_lora import LoRASegments, lora_apply_cpu
from llmplatform.kernels.ops import RowImpl
from llmplatform.models.layers import Linear
from llmplatform.models.parallel import ColumnParallelLinear, RowParallelLinear

Slices = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""slice index -> (A [r, in], scaled B [out_slice, r]) of one projection."""

LORA_TARGETS = {
    # PEFT's module name -> (our projection, its slice)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
"""The projections an adapter may adapt (embeddings and the LM head are not supported)."""

_PROJECTION_OWNERS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                      "down_proj": "mlp"}


@dataclass(frozen=True)
class LoRAGroup:
    """The rows of one step that use slot ``slot``; ``rows`` None: every row of the batch."""

    slot: int
    rows: torch.Tensor | None  # [num_rows] int64 on the model's device


@dataclass(frozen=True)
class LoRASmallGroups:
    """Several small groups of rows, padded to one size G and run as one batched product pair."""

    slots: torch.Tensor | None  # [num_groups] int64: each group's slot; None: group i is slot i,
    # every slot (no copy of the slots' weights: when most slots are in use, reading them all
    # costs less than gathering the used ones)
    gather_rows: torch.Tensor  # [num_groups * G] int64: rows of x, padding = num_rows (a zero row)
    scatter_rows: torch.Tensor  # [num_groups * G] int64: rows of y, padding = 0 (adds zeros there)
    size: int  # G


@dataclass(frozen=True)
class LoRABatch:
    groups: tuple[LoRAGroup, ...]  # each with its own product pair
    small: LoRASmallGroups | None = None
    segments: LoRASegments | None = None  # every group, for the C kernel (then groups and small are empty)


_current: contextvars.ContextVar[LoRABatch | None] = contextvars.ContextVar("lora_batch", default=None)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """The adapters of the rows of the forward pass run inside (None: the base model for all)."""
    if _current.get() is not None:
        raise RuntimeError("lora_batch does not nest: one forward pass at a time")
    token = _current.set(batch)
    try:
        yield
    finally:
        _current.reset(token)


class LoRALinear(nn.Module):
    """A projection (``models.layers.Linear``, or a rank's ``ColumnParallelLinear``) plus
    ``max_loras`` slots of LoRA weights for it. Its base product is unchanged; rows in a
    :class:`LoRABatch` group get their slot's low-rank update added."""

    def __init__(self, base: Linear, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.output_sizes = list(base.output_sizes)
        self.max_rank = max_rank
        in_features = self._in_features(base)
        num_slices = len(self.output_sizes)
        device, dtype = self._placement(base)
        self.uses_kernel = base.ops.lora is RowImpl.C
        if self.uses_kernel:  # the kernel widens the model's dtype in registers
            dtype = base.ops.dtype
            self.slice_offsets = torch.tensor([0, *itertools.accumulate(self.output_sizes)], dtype=torch.long)
            self.ranks = torch.zeros(max_loras, dtype=torch.long)  # each slot's adapter's rank
        # Otherwise slots hold the compute dtype (float32 on a CPU without bf16 matrix
        # instructions, where bf16 products are several times slower); rows are cast to it and
        # the update back.
        self.lora_a = torch.zeros(max_loras, num_slices * max_rank, in_features, dtype=dtype, device=device)
        # B is held transposed, B^T [L, S * R, out]: the expand's right-hand operand contiguous
        # (measured on CPU: a third faster for the batched expand; A's shrink is faster as is).
        self.lora_b_t = torch.zeros(max_loras, num_slices * max_rank, sum(self.output_sizes), dtype=dtype,
                                    device=device)
        # The whole model's sizes (what an adapter must fit); this rank's slots hold ``shard``.
        row = isinstance(base, RowParallelLinear)
        self.tp_size = base.group.size if row or isinstance(base, ColumnParallelLinear) else 1
        self.full_in_features = in_features * (self.tp_size if row else 1)
        self.full_output_sizes = [size * (1 if row else self.tp_size) for size in self.output_sizes]

    @staticmethod
    def _in_features(base: Linear) -> int:
        weight = base.weight if base.weight is not None else base._onednn_weight
        return int(base._row_weight.shape[1] if base._row_weight is not None else weight.shape[-1])

    @staticmethod
    def _placement(base: Linear) -> tuple[torch.device, torch.dtype]:
        for tensor in (base._row_weight, base.weight):
            if tensor is not None:
                return tensor.device, base.ops.compute_dtype
        return torch.device("cpu"), base.ops.compute_dtype

    def shard(self, slices: Slices, rank: int) -> Slices:
        """Rank ``rank``'s part of an adapter's whole-model ``slices`` (views): the whole A and,
        per slice, that rank's output rows of B (``ColumnParallelLinear.checkpoint_slice``'s)."""
        if self.tp_size == 1:
            return slices
        parts = {}
        for index, (a, b) in slices.items():
            rows = self.output_sizes[index]
            parts[index] = (a, b[rank * rows:(rank + 1) * rows])
        return parts

    def set_slot(self, slot: int, slices: Slices | None) -> None:
        """Writes an adapter into ``slot``: ``slices`` maps slice index -> (A [r, in], B [out_s, r]
        with the scaling folded in; this rank's part: ``shard``); slices it leaves out (and None:
        all) are zeroed."""
        self.lora_a[slot].zero_()
        self.lora_b_t[slot].zero_()
        if self.uses_kernel:
            self.ranks[slot] = max((a.shape[0] for a, _ in (slices or {}).values()), default=0)
        offset = 0
        for index, size in enumerate(self.output_sizes):
            if slices is not None and index in slices:
                a, b = slices[index]
                rank = a.shape[0]
                assert rank <= self.max_rank and b.shape == (size, rank), (a.shape, b.shape, size)
                first = index * self.max_rank  # this slice's rank rows of A, columns of B
                self.lora_a[slot, first:first + rank].copy_(a)
                self.lora_b_t[slot, first:first + rank, offset:offset + size].copy_(b.T)
            offset += size

    def forward(self, x: torch.Tensor,  # [T, in]
                out_dtype: torch.dtype | None = None) -> torch.Tensor:  # [T, sum(output_sizes)]
        y = self.base(x, out_dtype)
        batch = _current.get()
        if batch is None:
            return y
        if batch.segments is not None:
            lora_apply_cpu(x, y, self.lora_a, self.lora_b_t, self.slice_offsets, self.ranks, batch.segments)
            return y
        dtype = self.lora_a.dtype
        for group in batch.groups:
            xg = x if group.rows is None else x.index_select(0, group.rows)  # [n, in]
            shrunk = xg.to(dtype) @ self.lora_a[group.slot].T  # [n, S * R]
            delta = (shrunk @ self.lora_b_t[group.slot]).to(y.dtype)  # [n, out]
            if group.rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, group.rows, delta)
        small = batch.small
        if small is not None:
            padded = torch.cat((x.to(dtype), x.new_zeros((1, x.shape[1]), dtype=dtype)))  # [T + 1, in]
            xg = padded.index_select(0, small.gather_rows).view(-1, small.size, x.shape[1])  # [g, G, in]
            a = self.lora_a if small.slots is None else self.lora_a.index_select(0, small.slots)
            b_t = self.lora_b_t if small.slots is None else self.lora_b_t.index_select(0, small.slots)
            shrunk = torch.bmm(xg, a.transpose(1, 2))  # [g, G, S * R]
            delta = torch.bmm(shrunk, b_t)  # [g, G, out]
            y.index_add_(0, small.scatter_rows, delta.view(-1, delta.shape[-1]).to(y.dtype))
        return y


class _PartialProduct(nn.Module):
    """A row-parallel projection's product before its all-reduce (``RowParallelLinear`` sums it)."""

    def __init__(self, projection: RowParallelLinear) -> None:
        super().__init__()
        self.projection = projection

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return Linear.forward(self.projection, x, out_dtype)


class RowParallelLoRALinear(LoRALinear):
    """A rank's ``RowParallelLinear`` with LoRA slots: the delta of its input columns joins its
    partial product, and the all-reduce sums both (one collective, as without LoRA)."""

    def __init__(self, base: RowParallelLinear, max_loras: int, max_rank: int) -> None:
        super().__init__(base, max_loras, max_rank)
        self.group = base.group
        self.base = _PartialProduct(base)

    def shard(self, slices: Slices, rank: int) -> Slices:
        """Rank ``rank``'s input columns of A (``RowParallelLinear.checkpoint_slice``'s) and the
        whole B."""
        columns = self.lora_a.shape[-1]
        return {index: (a[:, rank * columns:(rank + 1) * columns], b) for index, (a, b) in slices.items()}

    def forward(self, x: torch.Tensor,  # [T, in / N]
                out_dtype: torch.dtype | None = None) -> torch.Tensor:  # [T, out], summed
        return self.group.all_reduce(super().forward(x, out_dtype))


def attach_lora(model: nn.Module, max_loras: int, max_rank: int) -> dict[tuple[int, str], LoRALinear]:
    """Wraps every projection of ``model``'s decoder layers that an adapter may adapt (a Llama-
    family layout: ``model.model.layers[i].self_attn.qkv_proj`` ...) with ``max_loras`` slots
    (a rank's sharded projections: this rank's share, see the module's doc); returns them by
    (layer index, projection name). Projections that are not plain ``Linear``
    (experts' stacked weights) stay as they are: an adapter for them is refused at load."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.model.layers):
        for name, owner_name in _PROJECTION_OWNERS.items():
            owner = getattr(layer, owner_name, None)
            projection = getattr(owner, name, None)
            if isinstance(projection, Linear):
                kind = RowParallelLoRALinear if isinstance(projection, RowParallelLinear) else LoRALinear
                lora = kind(projection, max_loras, max_rank)
                setattr(owner, name, lora)
                wrapped[(index, name)] = lora
                layer.c_layer = None  # an adapter's product is not in the one-call layer (models.decode_layer)
    return wrapped
