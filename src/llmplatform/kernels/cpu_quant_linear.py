"""Projections over weights held in GGUF block formats (``csrc/quant_linear.c``), with a torch
reference of the same signature.

A quantized weight ``[n, k]`` is a uint8 tensor ``[n, k / 32 * block_bytes]``: each row its
``k / 32`` blocks back to back, exactly as a GGUF file stores it (``gguf.GGUFReader`` hands them
out as such). Formats (``FORMATS``):

- ``q8_0``: 34 bytes a block, fp16 scale d then 32 int8 q: ``w = d * q``
- ``q4_1``: 20 bytes a block, fp16 scale d, fp16 min m, 16 bytes of nibbles (the low nibbles are
  weights 0-15, the high ones 16-31): ``w = d * q + m``

``quant_linear_cpu`` is the decode kernel: it reads each block once (1.06 bytes a weight for
Q8_0, 0.625 for Q4_1, where bf16 takes 2), widens it in registers and accumulates in fp32, so a
memory-bound step of a few rows reads 2-3x fewer bytes. ``dequantize_cpu`` writes the weight out in
bf16 or fp32 for products of many rows (a prefill chunk), which then run on ``F.linear``.
``quant_linear_reference`` and ``dequantize_reference`` do the same with torch ops (any device;
the tests' reference and the fallback where the C build is unavailable). ctypes releases the GIL
for the calls; the parallel loops run on the calling thread's OpenMP team (torch's intra-op
thread count).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmplatform.kernels import cbuild

BLOCK_WEIGHTS = 32
"""Weights per block in every supported format."""


@dataclass(frozen=True)
class BlockFormat:
    name: str
    code: int  # the C kernel's format number
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        return k // BLOCK_WEIGHTS * self.block_bytes


FORMATS = {"q8_0": BlockFormat("q8_0", 0, 34), "q4_1": BlockFormat("q4_1", 1, 20)}
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)

_pointer, _i64, _flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
kernel = cbuild.LazyFunction(
    "quant_linear.c", "quant_linear",
    [_pointer, _flag, _pointer, _flag, _pointer, _pointer, _flag, _i64, _i64, _i64, _flag], ctypes.c_int,
    "CPU quantized projection kernel")
dequantize_kernel = cbuild.LazyFunction(
    "quant_linear.c", "quant_dequantize", [_pointer, _flag, _pointer, _flag, _i64, _i64, _flag],
    ctypes.c_int, "CPU dequantization kernel")
available = kernel.available


def block_format(name: str) -> BlockFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown block format {name!r} (supported: {', '.join(FORMATS)})") from None


def in_features(blocks: torch.Tensor, fmt: str) -> int:
    """k of a ``[n, k / 32 * block_bytes]`` block tensor, checked."""
    bf = block_format(fmt)
    if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % bf.block_bytes:
        raise ValueError(f"{fmt} blocks must be uint8 [n, k / 32 * {bf.block_bytes}], got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")
    return blocks.shape[1] // bf.block_bytes * BLOCK_WEIGHTS


def _check_blocks(blocks: torch.Tensor, fmt: str) -> int:
    k = in_features(blocks, fmt)
    if blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise ValueError("quantized kernels: contiguous CPU blocks only")
    return k


def quant_linear_cpu(
    x: torch.Tensor,  # [m, k] bf16 or fp32
    blocks: torch.Tensor,  # [n, k / 32 * block_bytes] uint8, contiguous
    fmt: str,  # "q8_0" or "q4_1"
    bias: torch.Tensor | None = None,  # [n] fp32
    out_dtype: torch.dtype | None = None,  # default: x's dtype
) -> torch.Tensor:  # [m, n]
    function = kernel()
    out_dtype = out_dtype or x.dtype
    k = _check_blocks(blocks, fmt)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quant_linear_cpu: x {tuple(x.shape)} must be [m, {k}]")
    if x.dtype not in SUPPORTED_DTYPES or out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"quant_linear_cpu: dtypes {x.dtype} -> {out_dtype} unsupported")
    n = blocks.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError("quant_linear_cpu: bias must be a contiguous fp32 [n]")
    if x.device.type != "cpu":
        raise ValueError("quant_linear_cpu: CPU tensors only")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    rc = function(x.data_ptr(), int(x.dtype == torch.bfloat16), blocks.data_ptr(), FORMATS[fmt].code,
                  None if bias is None else bias.data_ptr(), y.data_ptr(), int(out_dtype == torch.bfloat16),
                  m, n, k, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("quant_linear_cpu: out of memory for the input rows")
    return y


def dequantize_cpu(blocks: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights ``[n, k]`` of ``blocks`` in ``dtype`` (bf16 rounded to nearest even)."""
    function = dequantize_kernel()
    k = _check_blocks(blocks, fmt)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize_cpu: dtype {dtype} unsupported")
    out = torch.empty(blocks.shape[0], k, dtype=dtype)
    if out.numel():
        rc = function(blocks.data_ptr(), FORMATS[fmt].code, out.data_ptr(), int(dtype == torch.bfloat16),
                      blocks.shape[0], k, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"dequantize_cpu: the kernel refused format {fmt} with k={k}")
    return out


def dequantize_reference(blocks: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize_cpu`` in torch ops (fp32 arithmetic, then ``dtype``)."""
    bf = block_format(fmt)
    k = in_features(blocks, fmt)
    n = blocks.shape[0]
    b = blocks.reshape(n, k // BLOCK_WEIGHTS, bf.block_bytes)  # [n, num_blocks, block_bytes]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, num_blocks, 1]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [n, num_blocks, 32]
        weights = q * d
    else:
        m = b[..., 2:4].contiguous().view(torch.float16).float()  # [n, num_blocks, 1]
        nibbles = b[..., 4:]  # [n, num_blocks, 16]
        q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).float()  # [n, num_blocks, 32]
        weights = q * d + m
    return weights.reshape(n, k).to(dtype)


def quant_linear_reference(
    x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``quant_linear_cpu`` in torch ops: dequantize to fp32 and multiply in fp32."""
    weight = dequantize_reference(blocks, fmt).to(x.device)
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)
