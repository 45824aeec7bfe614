"""The CPU projection kernels: ``y = x W^T (+ b)`` for the few rows of a decode step
(``csrc/small_linear.c``; on a CPU with AVX512-BF16, bf16 dot-product tiles for every decode step
of up to 64 rows) and for the 17-64 of a batched one on CPUs without bf16 instructions
(``csrc/blocked_linear.c``), built on first use (``cbuild``) and called through ctypes.

At 1-16 rows a projection's cost is reading its weight once: oneDNN's fp32 product over the fp32
copy that a CPU without bf16 matrix instructions multiplies in (``torch_utils.resolve_compute_dtype``)
reads 4 bytes a weight, and a bf16 product there widens the weight in memory on every call. The
C kernel streams the bf16 weight itself (2 bytes a weight), widens it in registers and
accumulates in fp32: the same arithmetic, half the bytes. fp32 weights work as well (the float32
parity tests run this path). A projection routes rows through it only when its model's ops plan
says so (``kernels.ops.ModelOps.small_rows``: the fused decode path); the eager path never calls it.

ctypes releases the GIL for the call; the parallel loop runs on the calling thread's OpenMP team.
"""

from __future__ import annotations

import ctypes

import torch

from llmplatform.kernels import cbuild

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)

_pointer, _i64, _flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
kernel = cbuild.LazyFunction(
    "small_linear.c", "small_linear",
    [_pointer, _flag, _pointer, _flag, _pointer, _pointer, _flag, _i64, _i64, _i64, _flag], ctypes.c_int,
    "CPU projection kernel")
"""The loaded kernel (built on the first call); raises ``cbuild.KernelUnavailableError`` if that
is impossible here."""
available = kernel.available
_dpbf16_rows = cbuild.LazyFunction("small_linear.c", "small_linear_dpbf16_rows", [], ctypes.c_int,
                                   "CPU projection kernel")


def dpbf16_rows() -> int:
    """The fewest rows ``small_linear_cpu`` multiplies over bf16 weights with AVX512-BF16 dot
    products on this CPU (1: all; fp32 input rows are rounded to bf16 first; fp32 weights widen
    with AVX2), or 0 where the kernel was built without them (the CPU lacks the instructions)."""
    return _dpbf16_rows()()


def small_linear_cpu(
    x: torch.Tensor,  # [m, k] bf16 or fp32
    weight: torch.Tensor,  # [n, k] bf16 or fp32, contiguous
    bias: torch.Tensor | None = None,  # [n] fp32
    out_dtype: torch.dtype | None = None,  # default: x's dtype
) -> torch.Tensor:  # [m, n]
    return _call(kernel(), "small_linear_cpu", x, weight, bias, out_dtype)


blocked_kernel = cbuild.LazyFunction(
    "blocked_linear.c", "blocked_linear",
    [_pointer, _flag, _pointer, _flag, _pointer, _pointer, _flag, _i64, _i64, _i64, _flag], ctypes.c_int,
    "CPU blocked projection kernel")
"""The register-blocked kernel for batched decode steps (``csrc/blocked_linear.c``): tiles of 5
input rows x 2 weight rows (4 x 4 where AVX-512 VL gives it 32 registers), so each widened weight
vector serves several rows and each input vector several columns (``small_linear``'s one weight
row at a time leaves it bound by input loads past ~16 rows). AVX2 + FMA only:
``blocked_unavailable`` says whether this CPU runs it."""

_blocked_probe = cbuild.LazyFunction("blocked_linear.c", "blocked_linear_features", [], ctypes.c_int,
                                     "CPU blocked projection kernel")


def blocked_probe() -> tuple[str | None, bool]:
    """(None when the blocked kernel builds here and this CPU has AVX2 and FMA, else why not;
    whether the CPU has AVX-512F), asked of the CPU at run time (``__builtin_cpu_supports``) for
    ``ops.probe_kernels``."""
    try:
        blocked_kernel()
        features = _blocked_probe()()
    except cbuild.KernelUnavailableError as exc:
        return str(exc), False
    return (None if features & 1 else "this CPU has no AVX2 + FMA"), bool(features & 2)


def blocked_unavailable() -> str | None:
    """Why the blocked kernel cannot run here, or None (``blocked_probe``)."""
    return blocked_probe()[0]


def blocked_linear_cpu(
    x: torch.Tensor,  # [m, k] bf16 or fp32
    weight: torch.Tensor,  # [n, k] bf16 or fp32, contiguous
    bias: torch.Tensor | None = None,  # [n] fp32
    out_dtype: torch.dtype | None = None,  # default: x's dtype
) -> torch.Tensor:  # [m, n]
    """``small_linear_cpu``'s product on the blocked kernel (any row count; built for 17-64)."""
    return _call(blocked_kernel(), "blocked_linear_cpu", x, weight, bias, out_dtype)


def _call(function, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          out_dtype: torch.dtype | None) -> torch.Tensor:
    """Checks the operands and runs ``function`` (both kernels take the same arguments)."""
    out_dtype = out_dtype or x.dtype
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "must be [m, k] and [n, k]")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES \
            or out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtypes {x.dtype}, {weight.dtype} -> {out_dtype} unsupported")
    if x.device.type != "cpu" or weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError(f"{name}: CPU tensors and a contiguous weight only")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)
                             or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous fp32 [n]")
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    rc = function(x.data_ptr(), int(x.dtype == torch.bfloat16), weight.data_ptr(),
                  int(weight.dtype == torch.bfloat16), None if bias is None else bias.data_ptr(),
                  y.data_ptr(), int(out_dtype == torch.bfloat16), m, n, k, torch.get_num_threads())
    if rc == -2:
        raise cbuild.KernelUnavailableError(f"{name}: this CPU has no AVX2 + FMA")
    if rc != 0:
        raise MemoryError(f"{name}: out of memory for the input rows")
    return y
