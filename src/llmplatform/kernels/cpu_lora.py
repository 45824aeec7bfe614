"""The CPU LoRA kernel (``csrc/lora.c``): every adapter group's ``y[rows] += (x[rows] A^T) B^T``
of one projection in one call, built on first use (``cbuild``) and called through ctypes.

Used by ``models.lora.LoRALinear`` when its model's ops plan says so (``ModelOps.lora``: the
fused decode path on a CPU where the C kernels build). Why a kernel: a decode step's adapters are
read once per step, in bytes comparable to the base model's weights, and torch's batched products
of a few rows per adapter stream them slowly (the numbers: docs/performance.md, "LoRA").

ctypes releases the GIL for the call; the parallel loops run on the calling thread's OpenMP team.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llmplatform.kernels import cbuild

_pointer, _i64, _flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
kernel = cbuild.LazyFunction(
    "lora.c", "lora_apply",
    [_pointer, _flag, _pointer, _flag, _i64, _i64, _pointer, _pointer, _flag, _i64,
     _pointer, _i64, _pointer, _pointer, _pointer, _pointer, _i64, _flag], ctypes.c_int,
    "CPU LoRA kernel")
"""The loaded kernel (built on the first call); raises ``cbuild.KernelUnavailableError`` if that
is impossible here."""


@dataclass(frozen=True)
class LoRASegments:
    """A step's rows grouped by adapter slot, as the kernel reads them (int64 CPU tensors)."""

    rows: torch.Tensor  # [N]: the rows of x and y, group after group
    group_starts: torch.Tensor  # [G + 1]: group g is rows[group_starts[g]:group_starts[g + 1]]
    slots: torch.Tensor  # [G]: each group's slot

    @classmethod
    def from_groups(cls, groups: list[tuple[int, list[int]]]) -> LoRASegments:
        """From (slot, rows) pairs."""
        rows: list[int] = []
        starts = [0]
        for _, group_rows in groups:
            rows += group_rows
            starts.append(len(rows))
        return cls(torch.tensor(rows, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                   torch.tensor([slot for slot, _ in groups], dtype=torch.long))


def lora_apply_cpu(
    x: torch.Tensor,  # [T, in] bf16 or fp32
    y: torch.Tensor,  # [T, out] bf16 or fp32, contiguous: updated in place
    a: torch.Tensor,  # [L, S * R, in] bf16 or fp32, contiguous
    b_t: torch.Tensor,  # [L, S * R, out], a's dtype, contiguous (block diagonal over the slices)
    slice_offsets: torch.Tensor,  # [S + 1] int64: the slices' output columns
    ranks: torch.Tensor,  # [L] int64: the rank of each slot's adapter (0: an empty slot)
    segments: LoRASegments,
) -> None:
    function = kernel()
    num_slices = slice_offsets.numel() - 1
    slots, width, in_features = a.shape
    out_features = b_t.shape[2]
    if (x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != in_features
            or y.shape[1] != out_features or b_t.shape[:2] != (slots, width) or width % num_slices
            or ranks.shape != (slots,)):
        raise ValueError(f"lora_apply_cpu: shapes x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
                         f"b_t {tuple(b_t.shape)}, {num_slices} slices, ranks {tuple(ranks.shape)} disagree")
    if a.dtype != b_t.dtype or any(t.dtype not in (torch.bfloat16, torch.float32) for t in (x, y, a)):
        raise TypeError(f"lora_apply_cpu: dtypes {x.dtype}, {y.dtype}, {a.dtype}, {b_t.dtype} unsupported")
    if not (y.is_contiguous() and a.is_contiguous() and b_t.is_contiguous()):
        raise ValueError("lora_apply_cpu: y, a and b_t must be contiguous")
    if segments.rows.numel() == 0:
        return
    x = x.contiguous()
    rc = function(x.data_ptr(), int(x.dtype == torch.bfloat16), y.data_ptr(), int(y.dtype == torch.bfloat16),
                  in_features, out_features, a.data_ptr(), b_t.data_ptr(), int(a.dtype == torch.bfloat16),
                  width // num_slices, slice_offsets.data_ptr(), num_slices, ranks.data_ptr(),
                  segments.rows.data_ptr(), segments.group_starts.data_ptr(), segments.slots.data_ptr(),
                  segments.slots.numel(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("lora_apply_cpu: out of memory for the grouped rows")
