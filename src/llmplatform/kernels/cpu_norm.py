"""RMSNorm with the fused residual add (``csrc/rms_norm.c``) for the fused decode path: one C
call per norm instead of the ~9 torch ops of ``models.layers.RMSNorm`` (at a few rows each of
those costs more in dispatch than in arithmetic). The same roundings as the eager module: the
add in the model dtype, the normalization in fp32, rounded, then scaled and rounded.
"""

from __future__ import annotations

import ctypes

import torch

from llmplatform.kernels import cbuild

_pointer, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
kernel = cbuild.LazyFunction(
    "rms_norm.c", "rms_norm",
    [_pointer, _pointer, _pointer, _pointer, _pointer, _i64, _i64, ctypes.c_float, _int, _int], None,
    "CPU RMSNorm kernel")
available = kernel.available


def rms_norm_cpu(
    x: torch.Tensor,  # [T, hidden] bf16 or fp32
    residual: torch.Tensor | None,  # [T, hidden] same dtype, or None (nothing to add)
    weight: torch.Tensor,  # [hidden] same dtype
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
    function = kernel()
    if x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype \
            or (residual is not None and residual.dtype != x.dtype):
        raise TypeError("rms_norm_cpu: x, residual and weight must share one dtype, bf16 or fp32")
    if x.dim() != 2 or weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm_cpu: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        new_residual = x
    else:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    function(x.data_ptr(), None if residual is None else residual.data_ptr(),
             None if residual is None else new_residual.data_ptr(), out.data_ptr(), weight.data_ptr(),
             x.shape[0], x.shape[1], eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out, new_residual
