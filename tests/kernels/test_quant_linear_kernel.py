"""The quantized projection kernels (``kernels/cpu_quant_linear.py``) against the ``gguf``
package's own dequantizer followed by a float64 product, the torch fallback likewise, and
``QuantizedLinear`` on both of its paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from llmplatform.kernels import cpu_quant_linear
from llmplatform.kernels.cpu_quant_linear import (dequantize_cpu, dequantize_reference, quant_linear_cpu,
                                                  quant_linear_reference)
from llmplatform.kernels.ops import ModelOps, RowImpl
from llmplatform.models.layers import Linear
from llmplatform.models.quantized import QuantizedLinear

needs_kernel = pytest.mark.usefixtures("cpu_kernels")  # no compiler: skip; a failed build: fail
QTYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}


def case(m: int, n: int, k: int, fmt: str, x_dtype: torch.dtype = torch.float32, seed: int = 0):
    """x [m, k], the blocks of a random [n, k] weight, the weight they hold (gguf's dequantizer,
    float64) and a bias."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) / k**0.5).astype(np.float32)
    weight[0, :32] = 0.0  # a constant block: Q4_1's scale is 0 there
    blocks = quantize(weight, QTYPES[fmt])  # [n, k / 32 * block_bytes] uint8
    held = torch.from_numpy(dequantize(blocks, QTYPES[fmt])).double()  # [n, k]
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(x_dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    return x, torch.from_numpy(blocks), held, bias


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 3, 8, 64])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantize_then_linear(fmt, m, x_dtype) -> None:
    x, blocks, held, bias = case(m, 45, 96, fmt, x_dtype)
    expected = F.linear(x.double(), held, bias.double())  # [m, 45]
    got = quant_linear_cpu(x, blocks, fmt, bias, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, 45)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)  # fp32 sums, any order
    rounded = quant_linear_cpu(x, blocks, fmt, bias, out_dtype=torch.bfloat16)
    assert torch.equal(rounded, got.to(torch.bfloat16))  # one rounding, to nearest even
    assert quant_linear_cpu(x, blocks, fmt).dtype == x_dtype  # default: the input's dtype


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_torch_fallback_matches_dequantize_then_linear(fmt, m) -> None:
    x, blocks, held, bias = case(m, 45, 96, fmt)
    torch.testing.assert_close(dequantize_reference(blocks, fmt).double(), held, rtol=0, atol=0)
    got = quant_linear_reference(x, blocks, fmt, bias)
    torch.testing.assert_close(got.double(), F.linear(x.double(), held, bias.double()), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_kernel_dequantizes_like_gguf(fmt) -> None:
    _, blocks, held, _ = case(1, 37, 160, fmt)
    got = dequantize_cpu(blocks, fmt, torch.float32).double()
    # Q8_0 is exact; Q4_1's d * q + m is one fused multiply-add in the kernel: its last bit may differ
    torch.testing.assert_close(got, held, rtol=2**-23, atol=1e-7)
    assert torch.equal(dequantize_cpu(blocks, fmt, torch.bfloat16), got.float().to(torch.bfloat16))


@needs_kernel
def test_rejects_what_it_does_not_handle() -> None:
    x, blocks, _, _ = case(2, 8, 64, "q8_0")
    with pytest.raises(ValueError, match="must be"):
        quant_linear_cpu(x[:, :32], blocks, "q8_0")
    with pytest.raises(ValueError, match="blocks must be"):
        quant_linear_cpu(x, blocks[:, :-1], "q8_0")  # not a whole number of blocks
    with pytest.raises(ValueError, match="unknown block format"):
        quant_linear_cpu(x, blocks, "q4_k")
    with pytest.raises(TypeError):
        quant_linear_cpu(x.half(), blocks, "q8_0")
    with pytest.raises(ValueError, match="bias"):
        quant_linear_cpu(x, blocks, "q8_0", torch.zeros(8, dtype=torch.bfloat16))


def quantized_linear(fmt: str, bias: bool, ops: ModelOps) -> tuple[QuantizedLinear, torch.Tensor]:
    """A fused two-shard projection [24 + 21, 96] and the weight its blocks hold (float64)."""
    _, blocks, held, b = case(1, 45, 96, fmt, seed=1)
    dense = Linear(96, [24, 21], bias=bias, dtype=torch.bfloat16, device="cpu", ops=ops)
    dense.weight.data.copy_(held)
    if bias:
        dense.bias.data.copy_(b)
    return QuantizedLinear.replacing(dense, blocks, fmt), held


EAGER = ModelOps(dtype=torch.bfloat16, compute_dtype=torch.float32, quantized=True)
FUSED = ModelOps(dtype=torch.bfloat16, compute_dtype=torch.float32, quantized=True, small_rows=16,
                 quantized_rows=16, dequantize=RowImpl.C)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_quantized_linear_dequantizes_on_the_eager_plan(fmt, m) -> None:
    layer, held = quantized_linear(fmt, bias=True, ops=EAGER)
    assert layer.weight is None and layer.in_features == 96 and layer.weight_bytes == blocks_bytes(fmt, 45, 96)
    assert layer.small_rows == -1  # never the kernel, not even for an empty call
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    expected = F.linear(x.double(), held, layer.bias.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)  # dequantized, F.linear


@needs_kernel
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_quantized_linear_on_the_fused_plan(fmt, m) -> None:
    layer, held = quantized_linear(fmt, bias=True, ops=FUSED)
    assert layer.small_rows == 16
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    expected = F.linear(x.double(), held, layer.bias.double())
    got = layer(x, out_dtype=torch.float32)  # the kernel up to 16 rows, the C dequantizer and F.linear above
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def blocks_bytes(fmt: str, n: int, k: int) -> int:
    return n * cpu_quant_linear.FORMATS[fmt].row_bytes(k)
