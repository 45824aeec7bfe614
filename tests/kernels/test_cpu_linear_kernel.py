"""The CPU small-row projection kernel (``kernels/cpu_linear.py``) against a float64 reference,
and the fused decode path's layers against the eager ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from llmplatform.kernels import cpu_linear
from llmplatform.models import layers
from llmplatform.models.layers import Linear

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # no compiler: skip; a failed build: fail


def case(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(w_dtype)
    bias = torch.randn(n, generator=g)
    return x, w, bias


@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 7, 8, 9, 17])  # 3-7: the fixed-row cases
@pytest.mark.parametrize("k", [64, 72, 100])  # 72: an 8-wide chunk after the 16-wide ones; 100: a tail past the last full 8-wide chunk
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_matches_a_float64_reference(m, k, x_dtype, w_dtype) -> None:
    x, w, bias = case(m, 37, k, x_dtype, w_dtype)
    dpbf16 = cpu_linear.dpbf16_rows()
    if w_dtype == torch.bfloat16 and x_dtype == torch.float32 and dpbf16 and m >= dpbf16:
        # on AVX512-BF16 dot products fp32 rows over bf16 weights are rounded to bf16 first
        expected = F.linear(x.bfloat16().double(), w.double(), bias.double())
    else:
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
    from llmplatform.kernels.ops import ModelOps

    fused = ModelOps(dtype=dtype, compute_dtype=torch.float32, small_rows=4)
    layer = Linear(48, [24, 8], bias=True, dtype=dtype, device="cpu", ops=fused)
    g = torch.Generator().manual_seed(1)
    layer.weight.copy_(torch.randn(32, 48, generator=g))
    layer.bias.copy_(torch.randn(32, generator=g))
    eager = Linear(48, [24, 8], bias=True, dtype=dtype, device="cpu",
                   ops=ModelOps(dtype=dtype, compute_dtype=torch.float32))
    eager.load_state_dict(layer.state_dict())
    layer.process_weights_after_loading()
    eager.process_weights_after_loading()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: the parallel loop
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_equals_the_eager_module(dtype, rows, with_residual) -> None:
    from llmplatform.kernels.cpu_norm import rms_norm_cpu
    from llmplatform.models.layers import RMSNorm

    norm = RMSNorm(96, 1e-5, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(rows)
    norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    x = (3 * torch.randn(rows, 96, generator=g)).to(dtype)
    residual = torch.randn(rows, 96, generator=g).to(dtype) if with_residual else None
    want, want_residual = norm(x, residual)
    got, got_residual = rms_norm_cpu(x, residual, norm.weight, norm.eps)
    assert torch.equal(got_residual, want_residual)  # the add rounds exactly as torch's
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # one rounding step apart at most (the fp32 sum of squares in another order)
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()
    from llmplatform.kernels.ops import ModelOps, RowImpl

    # A plan that puts norms on C runs every call there, past row_op_rows too (prefill chunks).
    routing = RMSNorm(96, 1e-5, dtype=dtype, device="cpu", ops=ModelOps(small_rows=8, row_op_rows=8, norm=RowImpl.C))
    routing.load_state_dict(norm.state_dict())
    routed, _ = routing(x, residual)
    assert torch.equal(routed, got)
    assert torch.equal(rms_norm_cpu(x[-1:], None if residual is None else residual[-1:], norm.weight, norm.eps)[0],
                       got[-1:])  # a row's result does not depend on the call's other rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_attention_equals_the_separate_ops(dtype, monkeypatch) -> None:
    """Rotary + K/V store + decode attention in two C calls against the eager ops on the same
    inputs: the same cache contents and the same attention output."""
    from llmplatform import kernels
    from llmplatform.models.rope import RotaryEmbedding

    H, Hkv, D, block_size = 4, 2, 32, 8
    g = torch.Generator().manual_seed(2)
    context_lens = [5, 17, 0]
    tables = [[3, 1], [0, 4, 6], [2]]
    metadata = kernels.AttentionMetadata.build(context_lens=context_lens, query_lens=[1, 1, 1],
                                               block_tables=tables, block_size=block_size)
    rotary = RotaryEmbedding(D, {"rope_type": "default", "rope_theta": 10000.0}, max_position=64,
                             trained_max_position=64, device="cpu")
    positions = torch.tensor(context_lens)
    cos, sin = rotary.cos_sin(positions, dtype)
    qkv = torch.randn(3, (H + 2 * Hkv) * D, generator=g).to(dtype)
    caches = [torch.randn(8, block_size, Hkv, D, generator=g).to(dtype) for _ in range(2)]
    fused_caches = [c.clone() for c in caches]

    qk = rotary(qkv[:, : (H + Hkv) * D].view(3, H + Hkv, D), cos, sin)
    v = qkv[:, (H + Hkv) * D:].view(3, Hkv, D)
    cpu = kernels.AttentionBackend.CPU
    kernels.store_kv_cache(qk[:, H:], v, *caches, metadata.slot_mapping, backend=cpu)
    want = kernels.paged_attention(qk[:, :H], qk[:, H:], v, *caches, metadata, D**-0.5, backend=cpu)

    got = kernels.fused_decode_attention(qkv, cos, sin, *fused_caches, metadata, H, D**-0.5)
    assert got is not None and got.dtype == torch.float32 and got.shape == (3, H, D)
    # bf16: the same roundings, the same bits; fp32: a fused multiply-add here and there
    tol = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(fused_caches[0], caches[0], **tol)
    assert torch.equal(fused_caches[1], caches[1])  # v: copied
    torch.testing.assert_close(got.to(dtype), want, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32
                                                       else {"rtol": 0, "atol": 0}))
    prefill = kernels.AttentionMetadata.build(context_lens=[5, 17, 0], query_lens=[1, 2, 1],
                                              block_tables=tables, block_size=block_size)
    wider = torch.randn(4, (H + 2 * Hkv) * D, generator=g).to(dtype)  # not decode-only: the caller's ops
    assert kernels.fused_decode_attention(wider, *rotary.cos_sin(torch.tensor([5, 17, 18, 0]), dtype),
                                          *fused_caches, prefill, H, D**-0.5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 70])  # 70: the parallel loop
def test_silu_mul_kernel_equals_the_eager_ops(dtype, rows) -> None:
    from llmplatform.kernels.cpu_activation import silu_mul_cpu
    from llmplatform.kernels.ops import ModelOps, RowImpl
    from llmplatform.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(rows, 2 * 300, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # the far tails and zero
    want = F.silu(gate_up[:, :300]) * gate_up[:, 300:]
    got = silu_mul_cpu(gate_up)
    assert got.dtype == dtype and got.shape == (rows, 300)
    assert torch.equal(silu_mul_cpu(gate_up[-1:]), got[-1:])  # a row's result does not depend on the split
    config = SimpleNamespace(hidden_size=16, intermediate_size=300, hidden_act="silu")
    for ops, c_rows in ((ModelOps(row_op_rows=8, activation=RowImpl.C), layers.ALL_ROWS), (ModelOps(), -1)):
        # every call on C where the plan says so (past row_op_rows: prefill chunks), else none
        assert LlamaMLP(config, dtype=dtype, device="cpu", ops=ops).c_rows == c_rows
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)
    else:  # the exp's last fp32 bit can move a rounding: at most one bf16 step, rarely
        steps = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)) > 2**-8
        assert steps.float().mean() < 0.01


def test_bf16_rows_on_dot_products_do_not_depend_on_their_batch() -> None:
    """Where the CPU has AVX512-BF16 (``cpu_linear.dpbf16_rows``: from 1 row), bf16 products sum
    each (row, weight row) pair in one fixed order and round it the same way whether it lands in
    a whole 4 x 4 tile or an edge one: a row's result is the same bits in a call of 1 row as in
    one of 11 (53 weight rows: an edge tile of columns; a tail chunk of k), in fp32 and in bf16.
    Elsewhere the AVX2 path runs (its accuracy: the float64 test above)."""
    start = cpu_linear.dpbf16_rows()
    if not start:
        pytest.skip("this CPU has no AVX512-BF16: bf16 rows widen to fp32 on AVX2")
    x, w, bias = case(11, 53, 200, torch.bfloat16, torch.bfloat16, seed=3)
    for out_dtype in (torch.float32, torch.bfloat16):
        whole = cpu_linear.small_linear_cpu(x, w, bias, out_dtype=out_dtype)
        for rows in range(start, 11):
            part = cpu_linear.small_linear_cpu(x[11 - rows:], w, bias, out_dtype=out_dtype)
            assert torch.equal(part, whole[11 - rows:])
