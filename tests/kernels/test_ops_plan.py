"""The ops plan (kernels/ops.py): which kernels a model runs, from (device, dtype, decode path,
attention setting, what builds here, quantized), decided once before the model is built; and the
row count that picks between the two kernels a plan names for a call (the blocked kernel's choice
for each kind of CPU: tests/kernels/test_blocked_linear.py)."""

from __future__ import annotations

import pytest
import torch

from llmplatform.kernels.cbuild import KernelUnavailableError
from llmplatform.kernels.ops import (
    DPBF16_ROWS,
    SMALL_ROWS,
    AttentionBackend,
    KernelAvailability,
    LinearImpl,
    RowImpl,
    resolve_ops,
)

BF16, F32 = torch.bfloat16, torch.float32
BUILT = KernelAvailability(triton=True, cpu_attention=None, row_kernels=None, quant_kernel=None,
                           dequantize_kernel=None, onednn_dtypes=(F32,), blocked_kernel=None)
NO_CC = KernelAvailability(triton=False, cpu_attention="no C compiler found", row_kernels="no C compiler found",
                           quant_kernel="no C compiler found", dequantize_kernel="no C compiler found",
                           onednn_dtypes=(F32,))
QUANT_BROKEN = KernelAvailability(triton=False, cpu_attention=None, row_kernels=None,
                                  quant_kernel="cc failed", dequantize_kernel=None, onednn_dtypes=(F32, BF16),
                                  blocked_kernel=None, bf16_matmul=True)
# a CPU with AVX512-BF16: the row kernel multiplies bf16 rows with dot products
DPBF16 = KernelAvailability(triton=False, cpu_attention=None, row_kernels=None, quant_kernel=None,
                            dequantize_kernel=None, onednn_dtypes=(F32, BF16), blocked_kernel=None,
                            bf16_matmul=True, avx512=True, dpbf16_rows=1)
AMX = KernelAvailability(triton=False, cpu_attention=None, row_kernels=None, quant_kernel=None,
                         dequantize_kernel=None, onednn_dtypes=(F32, BF16), blocked_kernel=None,
                         bf16_matmul=True, avx512=True, dpbf16_rows=1, amx=True)
CUDA = KernelAvailability(triton=True, cpu_attention="not a CPU model", row_kernels="not a CPU model",
                          quant_kernel="not a CPU model", dequantize_kernel="not a CPU model")
CUDA_NO_TRITON = KernelAvailability(triton=False, cpu_attention="not a CPU model", row_kernels="not a CPU model")

T, C = RowImpl.TORCH, RowImpl.C
A = AttentionBackend
# (device, dtype, compute dtype, decode path, attention, kernels, quantized[, partial rotary]) ->
# (attention, linear, small rows, norm/activation, rotary, quantized rows, dequantize, path, fallbacks)
CASES = [
    ("cpu", BF16, F32, "auto", "auto", BUILT, False, (A.CPU, LinearImpl.ONEDNN, SMALL_ROWS, C, C, 0, T, "fused", 0)),
    ("cpu", BF16, BF16, "auto", "auto", BUILT, False, (A.CPU, LinearImpl.TORCH, SMALL_ROWS, C, C, 0, T, "fused", 0)),
    ("cpu", F32, F32, "eager", "auto", BUILT, False, (A.CPU, LinearImpl.ONEDNN, 0, T, T, 0, T, "eager", 0)),
    ("cpu", BF16, F32, "auto", "auto", NO_CC, False, (A.TORCH, LinearImpl.ONEDNN, 0, T, T, 0, T, "eager", 1)),
    ("cpu", BF16, F32, "eager", "auto", NO_CC, False, (A.TORCH, LinearImpl.ONEDNN, 0, T, T, 0, T, "eager", 0)),
    # a forced torch attention keeps the row kernels but not the fused attention (it writes the cache its way)
    ("cpu", BF16, F32, "fused", "torch", BUILT, False, (A.TORCH, LinearImpl.ONEDNN, SMALL_ROWS, C, T, 0, T,
                                                         "fused", 0)),
    ("cpu", F32, F32, "fused", "triton", BUILT, False, (A.TRITON, LinearImpl.ONEDNN, SMALL_ROWS, C, T, 0, T,
                                                         "fused", 0)),
    ("cpu", BF16, BF16, "auto", "auto", BUILT, True, (A.CPU, LinearImpl.TORCH, SMALL_ROWS, C, C, SMALL_ROWS, C,
                                                       "fused", 0)),
    ("cpu", F32, F32, "eager", "auto", BUILT, True, (A.CPU, LinearImpl.ONEDNN, 0, T, T, 0, C, "eager", 0)),
    ("cpu", BF16, BF16, "auto", "auto", QUANT_BROKEN, True, (A.CPU, LinearImpl.ONEDNN, SMALL_ROWS, C, C, 0, C,
                                                              "fused", 1)),
    ("cpu", F32, F32, "auto", "auto", NO_CC, True, (A.TORCH, LinearImpl.ONEDNN, 0, T, T, 0, T, "eager", 1)),
    # AVX512-BF16: a bf16 model's products of every decode step (up to 64 rows) on the dot-product
    # kernel; an fp32 model's keep 16 (the kernel widens there), quantized products keep their 16
    ("cpu", BF16, BF16, "auto", "auto", DPBF16, False, (A.CPU, LinearImpl.ONEDNN, DPBF16_ROWS, C, C, 0, T,
                                                        "fused", 0)),
    ("cpu", F32, F32, "auto", "auto", DPBF16, False, (A.CPU, LinearImpl.ONEDNN, SMALL_ROWS, C, C, 0, T,
                                                      "fused", 0)),
    ("cpu", BF16, BF16, "auto", "auto", DPBF16, True, (A.CPU, LinearImpl.ONEDNN, DPBF16_ROWS, C, C, SMALL_ROWS, C,
                                                       "fused", 0)),
    # AMX: batched steps keep oneDNN's product on the tiles (small rows as elsewhere)
    ("cpu", BF16, BF16, "auto", "auto", AMX, False, (A.CPU, LinearImpl.ONEDNN, SMALL_ROWS, C, C, 0, T, "fused", 0)),
    ("cpu", BF16, BF16, "eager", "auto", DPBF16, False, (A.CPU, LinearImpl.ONEDNN, 0, T, T, 0, T, "eager", 0)),
    ("cuda", BF16, BF16, "auto", "auto", CUDA, False, (A.TRITON, LinearImpl.TORCH, 0, T, T, 0, T, "eager", 0)),
    ("cuda", F32, F32, "eager", "torch", CUDA, False, (A.TORCH, LinearImpl.TORCH, 0, T, T, 0, T, "eager", 0)),
    ("cuda", BF16, BF16, "auto", "auto", CUDA_NO_TRITON, False, (A.TORCH, LinearImpl.TORCH, 0, T, T, 0, T,
                                                                 "eager", 0)),
    # a model that rotates part of each head (Phi-3): the C rotary does whole heads, so its decode
    # rows keep the torch rotary and attention; the other row kernels stay
    ("cpu", BF16, F32, "auto", "auto", BUILT, False, (A.CPU, LinearImpl.ONEDNN, SMALL_ROWS, C, T, 0, T,
                                                       "fused", 0), True),
    ("cpu", F32, F32, "fused", "auto", BUILT, False, (A.CPU, LinearImpl.ONEDNN, SMALL_ROWS, C, T, 0, T,
                                                       "fused", 0), True),
]


@pytest.mark.parametrize("device, dtype, compute, path, attention, kernels, quantized, expected, partial_rotary",
                         [case if len(case) == 9 else (*case, False) for case in CASES])
def test_the_plan_for_each_case(device, dtype, compute, path, attention, kernels, quantized, expected,
                                partial_rotary) -> None:
    ops = resolve_ops(device, dtype, compute, kernels=kernels, decode_path=path, attention=attention,
                      quantized=quantized, partial_rotary=partial_rotary)
    got = (ops.attention, ops.linear, ops.small_rows, ops.norm, ops.rotary, ops.quantized_rows, ops.dequantize,
           ops.decode_path, len(ops.fallbacks))
    assert got == expected
    assert ops.activation is ops.norm and ops.quantized is quantized
    # the one-call layer (models.decode_layer) wherever the fused attention runs, unless quantized
    assert ops.layer is (C if ops.rotary is C and not quantized else T)
    assert (ops.device_type, ops.dtype, ops.compute_dtype) == (device, dtype, compute)
    for fallback in ops.fallbacks:  # the reason is named, not just "eager"
        assert any(reason in fallback for reason in ("no C compiler found", "cc failed"))


def test_onednn_is_a_setting_and_a_probe() -> None:
    assert resolve_ops("cpu", F32, kernels=BUILT, onednn=False).linear is LinearImpl.TORCH
    assert resolve_ops("cpu", BF16, kernels=BUILT).linear is LinearImpl.TORCH  # bf16 did not pass here
    assert resolve_ops("cpu", BF16, kernels=QUANT_BROKEN).linear is LinearImpl.ONEDNN


@pytest.mark.parametrize("device, path, attention, kernels, quantized, error", [
    ("cpu", "fused", "auto", NO_CC, False, KernelUnavailableError),  # fused where it cannot run: refused
    ("cuda", "fused", "auto", CUDA, False, ValueError),
    ("cpu", "eager", "cpu", NO_CC, False, KernelUnavailableError),  # a forced backend that cannot run
    ("cuda", "eager", "cpu", CUDA, False, ValueError),
    ("cuda", "eager", "triton", CUDA_NO_TRITON, False, ValueError),
    ("cpu", "eager", "cuda", BUILT, False, ValueError),
    ("cpu", "compiled", "auto", BUILT, False, ValueError),
    ("cuda", "eager", "auto", CUDA, True, ValueError),  # quantized projections are CPU only
])
def test_settings_that_cannot_be_honoured_are_refused(device, path, attention, kernels, quantized, error) -> None:
    with pytest.raises(error):
        resolve_ops(device, F32, kernels=kernels, decode_path=path, attention=attention, quantized=quantized)


def test_the_plan_is_frozen() -> None:
    ops = resolve_ops("cpu", F32, kernels=BUILT, decode_path="fused")
    with pytest.raises(AttributeError):
        ops.small_rows = 0  # type: ignore[misc]


@pytest.mark.parametrize("rows", [1, SMALL_ROWS, SMALL_ROWS + 1, 40])
def test_blocks_route_rows_by_the_threshold_the_plan_fixed(rows, monkeypatch) -> None:
    """A block built with a fused plan runs up to ``small_rows`` rows on the C kernel and more on
    the plan's product; one built with an eager plan never calls the kernel."""
    from tests.kernels.conftest import require_cpu_kernel

    require_cpu_kernel()
    from llmplatform.models import layers

    calls = []
    real = layers.small_linear_cpu
    monkeypatch.setattr(layers, "small_linear_cpu", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for path, expect in (("fused", [rows] if rows <= SMALL_ROWS else []), ("eager", [])):
        ops = resolve_ops("cpu", F32, kernels=BUILT, decode_path=path, onednn=False)
        layer = layers.Linear(32, [8, 8], bias=True, dtype=F32, device="cpu", ops=ops)
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
        layer.process_weights_after_loading()
        calls.clear()
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
        assert calls == expect


def test_an_empty_call_never_reaches_a_kernel_the_plan_did_not_choose() -> None:
    """Zero rows (a step with no sampling rows) on an eager plan: torch, not the C kernel."""
    from llmplatform.models import layers

    ops = resolve_ops("cpu", F32, kernels=NO_CC, decode_path="auto")
    layer = layers.Linear(8, [4], bias=False, dtype=F32, device="cpu", ops=ops)
    torch.nn.init.normal_(layer.weight)
    layer.process_weights_after_loading()
    assert layer(torch.empty(0, 8)).shape == (0, 4)
    norm = layers.RMSNorm(8, 1e-5, dtype=F32, device="cpu", ops=ops)
    assert norm.c_rows == -1 and layer.small_rows == -1
