"""The CPU small-row projection kernel (``kernels/cpu_linear.py``) against a float64 reference,
and the fused decode path's layers against the eager ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmplatform.kernels import cpu_linear
from llmplatform.models import layers
from llmplatform.models.layers import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="the C kernel does not build here")


def case(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(w_dtype)
    bias = torch.randn(n, generator=g)
    return x, w, bias


@pytest.mark.parametrize("m", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("k", [64, 100])  # 100: a tail past the last full 8-wide chunk
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_matches_a_float64_reference(m, k, x_dtype, w_dtype) -> None:
    x, w, bias = case(m, 37, k, x_dtype, w_dtype)
    expected = F.linear(x.double(), w.double(), bias.double())  # [m, 37]
    got = cpu_linear.small_linear_cpu(x, w, bias, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, 37)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)  # fp32 sums, any order
    rounded = cpu_linear.small_linear_cpu(x, w, bias, out_dtype=torch.bfloat16)
    assert torch.equal(rounded, got.to(torch.bfloat16))  # one rounding, to nearest even
    assert cpu_linear.small_linear_cpu(x, w).dtype == x_dtype  # default: the input's dtype


def test_bf16_rounding_keeps_nan_and_inf() -> None:
    x = torch.tensor([[1.0, 0.0], [float("inf"), 0.0]])
    w = torch.tensor([[1.0, 0.0], [float("nan"), 0.0]])
    got = cpu_linear.small_linear_cpu(x, w, out_dtype=torch.bfloat16).float()
    assert got[0, 0] == 1.0 and got[1, 0] == float("inf")
    assert torch.isnan(got[:, 1]).all()


def test_rejects_what_it_does_not_handle() -> None:
    x, w, _ = case(2, 8, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="must be"):
        cpu_linear.small_linear_cpu(x, w[:, :8])
    with pytest.raises(TypeError):
        cpu_linear.small_linear_cpu(x.half(), w)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.small_linear_cpu(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.small_linear_cpu(x, w, torch.zeros(8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_on_the_row_kernel_equals_the_eager_one_up_to_rounding(dtype, monkeypatch) -> None:
    """Up to ``max_rows`` rows go to the kernel (over the weight as loaded, even after an fp32
    compute copy is made); more rows keep the eager product."""
    layer = Linear(48, [24, 8], bias=True, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(1)
    layer.weight.copy_(torch.randn(32, 48, generator=g))
    layer.bias.copy_(torch.randn(32, generator=g))
    eager = Linear(48, [24, 8], bias=True, dtype=dtype, device="cpu")
    eager.load_state_dict(layer.state_dict())
    layer.use_row_kernel(max_rows=4)
    layer.use_compute_dtype(torch.float32)
    eager.use_compute_dtype(torch.float32)
    calls = []
    real = cpu_linear.small_linear_cpu

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(layers, "small_linear_cpu", counting)
    for rows in (1, 4, 5):
        x = torch.randn(rows, 48, generator=g).to(dtype)
        got, want = layer(x), eager(x)
        assert got.dtype == want.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    assert calls == [1, 4]  # 5 rows: the eager product
