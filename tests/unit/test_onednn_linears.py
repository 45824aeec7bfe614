"""CPU projections on oneDNN with prepacked weights (``kernels/onednn_linear.py``, chosen by the
ops plan: ``LinearImpl.ONEDNN``).

The choice must not change the numbers beyond the dtype's summation order and rounding, must leave
the LM head alone, must keep working for bf16 activations (the compute-dtype path) and biases,
must prepack bf16 weights only on CPUs with bf16 instructions, and must be off when
``LLMPLATFORM_ONEDNN_LINEARS=0``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmplatform.engine.config import ModelConfig
from llmplatform.engine.decode_path import ONEDNN_LINEARS_ENV_VAR, model_ops
from llmplatform.kernels import onednn_linear
from llmplatform.kernels.onednn_linear import onednn_rows
from llmplatform.kernels.ops import KernelAvailability, LinearImpl, ModelOps, resolve_ops
from llmplatform.models.layers import Linear, process_weights_after_loading

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def onednn_ops(dtype: torch.dtype) -> ModelOps:
    return ModelOps(dtype=dtype, compute_dtype=dtype, linear=LinearImpl.ONEDNN)


class Tiny(nn.Module):
    def __init__(self, bias: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        ops = onednn_ops(dtype)
        self.qkv_proj = Linear(64, [32, 16, 16], bias=bias, dtype=dtype, device="cpu", ops=ops)
        self.down_proj = Linear(96, [64], bias=False, dtype=dtype, device="cpu", ops=ops)
        self.lm_head = Linear(64, [300], bias=False, dtype=dtype, device="cpu", ops=ops, prepack=False)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(dtype))


def prepacked(model: nn.Module) -> int:
    process_weights_after_loading(model)
    return sum(1 for m in model.modules() if isinstance(m, Linear) and m._onednn_weight is not None)


@pytest.mark.parametrize("bias", [True, False])
def test_same_products_as_f_linear_for_any_row_count(bias: bool, monkeypatch) -> None:
    model = Tiny(bias)
    plain = {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for name, m in model.named_modules() if isinstance(m, Linear)}
    assert prepacked(model) == 2
    assert model.qkv_proj.weight is None and model.down_proj.weight is None  # replaced, not copied
    assert model.lm_head.weight is not None and model.lm_head._onednn_weight is None  # left alone
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 16, 17, 32, 33, 100, 160, 1001):  # exact and padded row counts
        for name in ("qkv_proj", "down_proj"):
            layer = getattr(model, name)
            weight, b = plain[name]
            x = torch.randn(rows, weight.shape[1], generator=gen)
            torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
            # bf16 activations (--compute-dtype float32 over a bf16 model): widened, rounded back
            xb = x.to(torch.bfloat16)
            got = layer(xb)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, F.linear(xb.float(), weight, b).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    strided = torch.randn(8, 128, generator=gen)[:, ::2]  # a non-contiguous input
    torch.testing.assert_close(model.qkv_proj(strided), F.linear(strided, *plain["qkv_proj"]), rtol=1e-5, atol=1e-5)


def test_the_switch_is_off_by_environment(monkeypatch) -> None:
    onednn_linear.working_dtypes()  # probed before (cached): the setting alone must turn it off
    config = ModelConfig("m", ("m",), decode_path="eager")
    cpu = torch.device("cpu")
    monkeypatch.delenv(ONEDNN_LINEARS_ENV_VAR, raising=False)
    assert model_ops(config, cpu, torch.float32, torch.float32).linear is LinearImpl.ONEDNN
    monkeypatch.setenv(ONEDNN_LINEARS_ENV_VAR, "0")
    assert model_ops(config, cpu, torch.float32, torch.float32).linear is LinearImpl.TORCH


def test_bf16_weights_are_left_alone_without_bf16_instructions(monkeypatch) -> None:
    monkeypatch.setattr(onednn_linear, "onednn_weight_dtypes", lambda: (torch.float32,))
    onednn_linear.working_dtypes.cache_clear()
    try:
        working = onednn_linear.working_dtypes()
    finally:
        onednn_linear.working_dtypes.cache_clear()
    assert working == (torch.float32,)
    kernels = KernelAvailability(onednn_dtypes=working)
    assert resolve_ops("cpu", torch.bfloat16, kernels=kernels).linear is LinearImpl.TORCH
    assert resolve_ops("cpu", torch.bfloat16, torch.float32, kernels=kernels).linear is LinearImpl.ONEDNN


class TinyBf16(Tiny):
    def __init__(self, bias: bool) -> None:
        super().__init__(bias, torch.bfloat16)


def _cpu_can_pack_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= set(flags)


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_weights_are_prepacked_with_bf16_instructions(bias: bool, monkeypatch) -> None:
    """On CPUs with bf16 matrix instructions the bf16 projections are prepacked too: the same
    products as F.linear (bf16 in, bf16 out), for exact and padded row counts."""
    # The skip depends on the CPU, never on the probe's own answer (a broken probe must fail):
    # oneDNN's packed bf16 linear needs AVX-NE-CONVERT or AVX-512 BW+VL+DQ (its own message).
    works = onednn_linear.check(torch.bfloat16) is None
    if not _cpu_can_pack_bf16():
        assert not works
        pytest.skip("this CPU has neither AVX-NE-CONVERT nor AVX-512 BW/VL/DQ: oneDNN packs no bf16 linear")
    assert works
    model = TinyBf16(bias)
    plain = {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for name, m in model.named_modules() if isinstance(m, Linear)}
    assert prepacked(model) == 2
    assert model.qkv_proj.weight is None and model.qkv_proj.weight_dtype == torch.bfloat16
    assert model.lm_head.weight is not None and model.lm_head._onednn_weight is None
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 16, 17, 33, 160):
        for name in ("qkv_proj", "down_proj"):
            weight, b = plain[name]
            x = torch.randn(rows, weight.shape[1], generator=gen).to(torch.bfloat16)
            got = getattr(model, name)(x)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, weight.shape[0])
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1.6e-2, atol=1e-2)
            # float32 activations (a caller outside the engine): multiplied in bf16, returned in float32
            assert getattr(model, name)(x.float()).dtype == torch.float32


def test_the_bf16_switch_follows_the_cpu() -> None:
    from llmplatform.utils.torch_utils import cpu_has_native_low_precision_matmul

    expected = torch.bfloat16 in onednn_linear.onednn_weight_dtypes()
    assert expected == cpu_has_native_low_precision_matmul(torch.bfloat16)
    assert torch.float32 in onednn_linear.onednn_weight_dtypes()


def test_a_misbehaving_backend_is_not_chosen(monkeypatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    onednn_linear.working_dtypes.cache_clear()
    try:
        assert onednn_linear.working_dtypes() == ()
    finally:
        onednn_linear.working_dtypes.cache_clear()
    assert "no oneDNN here" in onednn_linear.check(torch.float32)
    assert "oneDNN linears unavailable" in caplog.text
    assert resolve_ops("cpu", torch.float32, kernels=KernelAvailability()).linear is LinearImpl.TORCH


def test_row_counts_are_rounded_to_a_few_shapes() -> None:
    """oneDNN keeps a kernel per input shape: the shapes a worker can produce stay few (memory),
    and the rounding costs at most 1/8 more rows."""
    seen = {onednn_rows(rows) for rows in range(1, 8193)}
    assert len(seen) <= 16 + 8 * 9  # exact up to 16, then 8 per doubling up to 8192
    for rows in range(1, 8193):
        padded = onednn_rows(rows)
        assert rows <= padded <= rows + rows // 8
        assert onednn_rows(padded) == padded  # a rounded count is its own shape
    assert [onednn_rows(r) for r in (1, 16, 17, 18, 33, 64, 65, 2048, 2049)] == [1, 16, 18, 18, 36, 64, 72, 2048, 2304]
