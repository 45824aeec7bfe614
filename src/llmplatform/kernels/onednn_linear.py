"""CPU projections on oneDNN over a weight prepacked once (``ops.LinearImpl.ONEDNN``).

``F.linear`` re-lays-out the weight on every call (float32: MKL's sgemm; bf16: oneDNN's matmul
over a plain weight); with the few rows of a decode step that costs as much as the product.
oneDNN's linear over a weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``, no extra
memory: the packed copy replaces the plain one) made the engine 4-6% faster at 32 concurrent
requests in float32 on a 2-core AVX-512 Xeon, and SmolLM2's 30 layers of bf16 projections 1.6x
faster for a 32-row decode step on a 2-core AVX512-BF16 EPYC (27 -> 17 ms, the same bits).
Results agree with ``F.linear`` to the dtype's rounding (another summation order);
``working_dtypes`` checks that once per dtype before a plan chooses it.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

logger = logging.getLogger("llmplatform.kernels")

_EXACT_ROWS = 16


def onednn_rows(rows: int) -> int:
    """How many rows a oneDNN product over ``rows`` input rows is computed with (zero rows
    appended, the extra outputs dropped).

    oneDNN builds and caches a kernel for every input shape it sees, about 0.6 MiB each on this
    CPU whatever the weight's size, and a server sees a new row count (tokens in a step) nearly
    every step: unbounded, the worker's memory grew by ~40 MiB per 200 requests (the soak test)
    until the 1,024-entry cache filled. Up to 16 rows are exact (decode batches; padding would
    be free there anyway, the product reads the weights once); above, a row count is rounded up
    to 8 steps per power of two, so at most 1/8 more rows are computed and a worker uses at most
    16 + 8 per doubling of its largest step (about 100 shapes per projection).
    """
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_weight_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes whose CPU projections may be prepacked: float32, and bfloat16 on CPUs
    with bf16 matrix instructions (elsewhere oneDNN emulates bf16 and the engine multiplies in
    float32 anyway: ``torch_utils.resolve_compute_dtype``)."""
    from llmplatform.utils.torch_utils import cpu_has_native_low_precision_matmul

    if cpu_has_native_low_precision_matmul(torch.bfloat16):
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def prepack(weight: torch.Tensor) -> torch.Tensor:  # [n, k] -> oneDNN's layout, same dtype
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(x: torch.Tensor,  # [T, k]
                  packed: torch.Tensor,  # prepack(weight)
                  bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:  # [T, n] in out_dtype (default: x's)
    dtype = packed.dtype
    out_dtype = out_dtype or x.dtype
    rows = x.shape[0]
    padded = onednn_rows(rows)
    xw = x.to(dtype)
    if padded != rows:
        xw = F.pad(xw, (0, 0, 0, padded - rows))
    y = torch.ops.mkldnn._linear_pointwise(xw.contiguous(), packed, bias, "none", [], "")[:rows]
    return y if out_dtype == dtype else y.to(out_dtype)


def check(dtype: torch.dtype) -> str | None:
    """None when the prepacked product agrees with ``F.linear`` in ``dtype`` here, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(24, 64, generator=gen) * 0.1).to(dtype)
    bias = (torch.randn(24, generator=gen) * 0.1).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    expected = F.linear(x, weight, bias).float()
    # float32: summation order only; bf16: plus the output's rounding (8 bits of mantissa).
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2 * expected.abs().max().item())
    try:
        got = onednn_linear(x, prepack(weight), bias).float()
    except Exception as exc:  # a torch without oneDNN's packed linear, or one that misbehaves
        return f"{type(exc).__name__}: {exc}"
    if not torch.allclose(got, expected, rtol=rtol, atol=atol):
        return f"differs from F.linear by {(got - expected).abs().max().item():.2e}"
    return None


@cache
def working_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes of ``onednn_weight_dtypes`` whose prepacked product passes ``check`` (a
    failure is logged once: those projections use F.linear)."""
    working = []
    for dtype in onednn_weight_dtypes():
        reason = check(dtype)
        if reason is None:
            working.append(dtype)
        else:
            logger.warning("oneDNN linears unavailable for %s weights (%s): their projections use F.linear",
                           str(dtype).removeprefix("torch."), reason)
    return tuple(working)
