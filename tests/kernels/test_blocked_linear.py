"""The blocked AVX2 projection kernel for batched decode steps (``cpu_linear.blocked_linear_cpu``,
``csrc/blocked_linear.c``): parity with a float64 reference and with ``F.linear`` in fp32 over the
same weights, the rows a ``Linear`` sends it, and the plan's choice for each kind of CPU, faked
through the feature probes (``ops.probe_kernels``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmplatform.kernels import cpu_linear
from llmplatform.kernels.cbuild import KernelUnavailableError
from llmplatform.kernels.ops import (
    BLOCKED_ROWS,
    SMALL_ROWS,
    KernelAvailability,
    ModelOps,
    plan_ops,
    resolve_ops,
)
from llmplatform.models import layers
from tests.kernels.conftest import require_cpu_kernel

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture
def blocked() -> None:
    """The kernel built and runnable here (a CPU without AVX2 + FMA: skipped)."""
    require_cpu_kernel(cpu_linear.kernel, cpu_linear.blocked_kernel)
    reason = cpu_linear.blocked_unavailable()
    if reason is not None:
        pytest.skip(reason)


def case(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(w_dtype)
    bias = torch.randn(n, generator=g)
    return x, w, bias


@pytest.mark.usefixtures("blocked")
@pytest.mark.parametrize("m", [1, 17, 31, 64, 100])
@pytest.mark.parametrize("n, k", [(37, 100), (101, 577), (8, 16)])  # odd: tails past every tile and chunk
@pytest.mark.parametrize("x_dtype, w_dtype", [(F32, BF16), (BF16, BF16), (F32, F32), (BF16, F32)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_f_linear_in_fp32_over_the_same_weights(m, n, k, x_dtype, w_dtype, with_bias) -> None:
    x, w, bias = case(m, n, k, x_dtype, w_dtype, seed=m + n)
    bias = bias if with_bias else None
    reference = F.linear(x.double(), w.double(), None if bias is None else bias.double())  # [m, n]
    got = cpu_linear.blocked_linear_cpu(x, w, bias, out_dtype=F32)
    assert got.dtype == F32 and got.shape == (m, n)
    # fp32 sums in another order: a few ulps of the terms' magnitude, not of the result's
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=1e-6 * scale)
    fp32 = F.linear(x.float(), w.float(), bias)  # what the fp32 copy's product gives
    torch.testing.assert_close(got, fp32, rtol=1e-5, atol=1e-5 * scale)
    rounded = cpu_linear.blocked_linear_cpu(x, w, bias, out_dtype=BF16)
    assert torch.equal(rounded, got.to(BF16))  # one rounding, to nearest even
    assert cpu_linear.blocked_linear_cpu(x, w).dtype == x_dtype  # default: the input's dtype


@pytest.mark.usefixtures("blocked")
def test_special_values_and_refusals() -> None:
    x = torch.zeros(20, 16)
    x[0, 0], x[1, 0] = 1.0, float("inf")
    w = torch.zeros(3, 16, dtype=BF16)
    w[0, 0], w[1, 0] = 1.0, float("nan")
    got = cpu_linear.blocked_linear_cpu(x, w, out_dtype=BF16).float()
    assert got[0, 0] == 1.0 and got[1, 0] == float("inf") and torch.isnan(got[:, 1]).all()
    assert cpu_linear.blocked_linear_cpu(torch.empty(0, 16), w).shape == (0, 3)
    with pytest.raises(ValueError, match="must be"):
        cpu_linear.blocked_linear_cpu(x, w[:, :8])
    with pytest.raises(TypeError):
        cpu_linear.blocked_linear_cpu(x.half(), w)
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.blocked_linear_cpu(x, w, torch.zeros(3, dtype=BF16))


@pytest.mark.usefixtures("blocked")
def test_a_linear_routes_each_row_count_to_one_kernel(monkeypatch) -> None:
    """Up to ``small_rows`` rows: the small-row kernel; up to ``blocked_rows``: the blocked one
    (both over the bf16 weight as loaded, after the fp32 compute copy is made); more: the plan's
    product over that copy."""
    ops = ModelOps(dtype=BF16, compute_dtype=F32, small_rows=SMALL_ROWS, blocked_rows=BLOCKED_ROWS)
    layer = layers.Linear(48, [24, 9], bias=True, dtype=BF16, device="cpu", ops=ops)
    g = torch.Generator().manual_seed(1)
    layer.weight.copy_(torch.randn(33, 48, generator=g))
    layer.bias.copy_(torch.randn(33, generator=g))
    weight, bias = layer.weight.detach().float().clone(), layer.bias.detach().float().clone()
    layer.process_weights_after_loading()
    assert layer.weight.dtype == F32 and layer._row_weight.dtype == BF16
    calls = []
    for name in ("small_linear_cpu", "blocked_linear_cpu"):
        real = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda x, *a, _real=real, _name=name: calls.append(
            (_name, x.shape[0])) or _real(x, *a))
    for rows in (1, SMALL_ROWS, SMALL_ROWS + 1, 40, BLOCKED_ROWS, BLOCKED_ROWS + 1):
        x = torch.randn(rows, 48, generator=g).to(BF16)
        want = F.linear(x.float(), weight, bias)
        torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert calls == [("small_linear_cpu", 1), ("small_linear_cpu", SMALL_ROWS),
                     ("blocked_linear_cpu", SMALL_ROWS + 1), ("blocked_linear_cpu", 40),
                     ("blocked_linear_cpu", BLOCKED_ROWS)]


# ---- the plan ---------------------------------------------------------------------------------

AVX2_ONLY = KernelAvailability(cpu_attention=None, row_kernels=None, onednn_dtypes=(F32,), blocked_kernel=None,
                               bf16_matmul=False)
BF16_CPU = KernelAvailability(cpu_attention=None, row_kernels=None, onednn_dtypes=(F32, BF16),
                              blocked_kernel=None, bf16_matmul=True)  # AVX512-BF16 or AMX
AVX512_NO_BF16 = KernelAvailability(cpu_attention=None, row_kernels=None, onednn_dtypes=(F32,),
                                    blocked_kernel=None, bf16_matmul=False, avx512=True)  # Skylake-Ice Lake
NO_AVX2 = KernelAvailability(cpu_attention=None, row_kernels=None, onednn_dtypes=(F32,),
                             blocked_kernel="this CPU has no AVX2 + FMA", bf16_matmul=False)


@pytest.mark.parametrize("device, dtype, compute, path, kernels, choice, rows, fallbacks", [
    ("cpu", BF16, F32, "auto", AVX2_ONLY, "auto", BLOCKED_ROWS, 0),  # what it is for
    ("cpu", BF16, BF16, "auto", AVX2_ONLY, "auto", BLOCKED_ROWS, 0),  # --compute-dtype model: emulated bf16
    ("cpu", BF16, BF16, "auto", BF16_CPU, "auto", 0, 0),  # oneDNN's bf16 product
    ("cpu", BF16, F32, "auto", NO_AVX2, "auto", 0, 1),  # the fp32 copy's product, and why
    ("cpu", BF16, F32, "auto", AVX512_NO_BF16, "auto", 0, 0),  # oneDNN's 16-wide fp32 GEMM (unmeasured)
    ("cpu", BF16, F32, "auto", AVX512_NO_BF16, "on", BLOCKED_ROWS, 0),
    ("cpu", F32, F32, "auto", AVX2_ONLY, "auto", 0, 0),  # an fp32 model: oneDNN over its own weights
    ("cpu", BF16, F32, "eager", AVX2_ONLY, "auto", 0, 0),  # the reference path stays torch
    ("cpu", BF16, F32, "auto", AVX2_ONLY, "off", 0, 0),
    ("cpu", BF16, BF16, "auto", BF16_CPU, "on", BLOCKED_ROWS, 0),  # forced (tests, benchmarks)
    ("cpu", F32, F32, "eager", AVX2_ONLY, "on", BLOCKED_ROWS, 0),
    ("cuda", BF16, BF16, "auto", KernelAvailability(), "auto", 0, 0),
])
def test_the_plan_for_each_kind_of_cpu(device, dtype, compute, path, kernels, choice, rows, fallbacks) -> None:
    ops = resolve_ops(device, dtype, compute, kernels=kernels, decode_path=path, blocked=choice)
    assert ops.blocked_rows == rows and len(ops.fallbacks) == fallbacks
    assert ("on the blocked AVX2 kernel" in ops.summary()) == bool(rows)
    if fallbacks:
        assert "no AVX2 + FMA" in ops.fallbacks[0]
    if rows and ops.small_rows:
        assert f"products of {SMALL_ROWS + 1}-{BLOCKED_ROWS} rows on the blocked" in ops.summary()


def test_settings_that_cannot_be_honoured_are_refused() -> None:
    with pytest.raises(KernelUnavailableError, match="AVX2"):
        resolve_ops("cpu", BF16, F32, kernels=NO_AVX2, decode_path="auto", blocked="on")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_ops("cuda", BF16, BF16, kernels=KernelAvailability(), blocked="on")
    with pytest.raises(ValueError, match="blocked"):
        resolve_ops("cpu", BF16, F32, kernels=AVX2_ONLY, blocked="yes")


@pytest.mark.parametrize("cpu, expected_rows", [("avx2", BLOCKED_ROWS), ("avx512_bf16", 0), ("amx", 0),
                                                ("avx512", 0), ("no_avx2", 0)])
def test_the_probes_decide_it(cpu, expected_rows, monkeypatch, request) -> None:
    """``plan_ops`` on this machine with its CPU's features faked where they are asked: torch's
    bf16 probes (``torch_utils.cpu_has_native_low_precision_matmul``) and the kernel's own
    ``__builtin_cpu_supports`` answer (``cpu_linear.blocked_unavailable``). The oneDNN dtypes
    probed under the fake are not kept for later tests (on a bf16 CPU they would lack bf16)."""
    from llmplatform.kernels import onednn_linear

    require_cpu_kernel()
    onednn_linear.working_dtypes.cache_clear()
    request.addfinalizer(onednn_linear.working_dtypes.cache_clear)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: cpu == "avx512_bf16", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: cpu == "amx", raising=False)

    class Probe:  # the C function's answer: bit 1 with AVX2 + FMA, bit 2 with AVX-512F
        def __call__(self):
            return lambda: int(cpu != "no_avx2") | (2 if cpu.startswith("avx512") or cpu == "amx" else 0)

    monkeypatch.setattr(cpu_linear, "_blocked_probe", Probe())
    ops = plan_ops("cpu", BF16, F32 if cpu in ("avx2", "avx512", "no_avx2") else BF16, decode_path="auto")
    assert ops.decode_path == "fused" and ops.blocked_rows == expected_rows
    said = [fallback for fallback in ops.fallbacks if "blocked kernel" in fallback]
    assert len(said) == (cpu == "no_avx2") and all("no AVX2 + FMA" in fallback for fallback in said)
