"""``silu(gate) * up`` in one C pass (``csrc/silu_mul.c``) for the fused path's MLP (every
call: decode steps and prefill chunks, whose rows it splits over torch's thread count), with the
eager roundings (silu rounded to the model dtype, then the product)."""

from __future__ import annotations

import ctypes

import torch

from llmplatform.kernels import cbuild

kernel = cbuild.LazyFunction("silu_mul.c", "silu_mul",
                             [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int],
                             None, "CPU SiLU-and-mul kernel")
available = kernel.available


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    function = kernel()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in (torch.bfloat16, torch.float32) \
            or gate_up.device.type != "cpu":
        raise ValueError(f"silu_mul_cpu: expected a CPU bf16/fp32 [T, 2 I] tensor, got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, size, dtype=gate_up.dtype)
    function(gate_up.data_ptr(), out.data_ptr(), rows, size, int(gate_up.dtype == torch.bfloat16),
             torch.get_num_threads())
    return out
