"""Building blocks of the Llama family: linear layers that load fused, RMSNorm, rotary embedding.

Each block takes its model's ``ModelOps`` (``kernels.ops``, resolved once at build) and runs the
kernels it names; a block built without one runs the torch reference.

Parameters are created empty (the loader fills them) and never require grad: these modules serve
inference only, so no autograd graph is ever recorded, whatever mode the caller runs in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmplatform.kernels.cpu_linear import small_linear_cpu
from llmplatform.kernels.cpu_norm import rms_norm_cpu
from llmplatform.kernels import onednn_linear
from llmplatform.kernels.ops import LinearImpl, ModelOps, RowImpl


def reference_ops(dtype: torch.dtype, device: torch.device | str) -> ModelOps:
    """The ops of a block built without a plan: torch everywhere, products in ``dtype`` (tests and
    tools that build single blocks; a model always passes its plan)."""
    return ModelOps(device_type=torch.device(device).type, dtype=dtype, compute_dtype=dtype)


def kernel_rows(limit: int) -> int:
    """The most rows a block sends to a C kernel for a plan's row ``limit``: -1 for 0, so that an
    empty call (zero sampling rows, say) never reaches a kernel the plan did not choose."""
    return limit if limit > 0 else -1


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). With several ``output_sizes`` it is a fused projection: the checkpoint's
    separate matrices (q/k/v, gate/up) are stacked along the output dim, shard i at rows
    ``sum(output_sizes[:i]) ..``; one matmul replaces several, which matters on CPU.

    How it multiplies is its model's plan (``ops``): products of up to ``ops.small_rows`` rows on
    the C kernel (``kernels.cpu_linear``) over the weight as loaded, larger ones on ``ops.linear``
    over the weight in ``ops.compute_dtype`` (oneDNN's prepacked copy unless ``prepack`` is False:
    the LM head, whose vocabulary-sized product gains nothing). ``process_weights_after_loading``
    makes those forms of the weight once, after the loader filled it."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: ModelOps | None = None,
        prepack: bool = True,
    ) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        self.output_sizes = list(output_sizes)
        self.weight = _empty_param(sum(self.output_sizes), in_features, dtype=dtype, device=device)
        self.bias = _empty_param(sum(self.output_sizes), dtype=dtype, device=device) if bias else None
        self.ops = ops
        self.small_rows = kernel_rows(ops.small_rows)  # products of up to this many rows on the C kernel
        self._prepack = prepack and ops.linear is LinearImpl.ONEDNN
        self._onednn_weight: torch.Tensor | None = None
        self._row_weight: torch.Tensor | None = None  # the weight as loaded, for the C kernel
        self._row_bias: torch.Tensor | None = None  # fp32

    def process_weights_after_loading(self) -> None:
        """The forms of the loaded weight the plan multiplies with (once, at model build)."""
        if self.small_rows >= 0:
            self._row_weight = self.weight.detach().contiguous()
            self._row_bias = None if self.bias is None else self.bias.detach().float().contiguous()
        dtype = self.ops.compute_dtype
        if self.weight.dtype != dtype:  # see torch_utils.resolve_compute_dtype
            self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        if self._prepack:  # the packed copy replaces the plain one (no extra memory)
            self._onednn_weight = onednn_linear.prepack(self.weight)
            self.weight = None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype products of many rows run in (the weight's, plain or prepacked)."""
        return (self.weight if self._onednn_weight is None else self._onednn_weight).dtype

    def forward(self, x: torch.Tensor,  # [T, in]
                out_dtype: torch.dtype | None = None,  # default: x's
                ) -> torch.Tensor:  # [T, sum(output_sizes)]
        if x.shape[0] <= self.small_rows:
            return small_linear_cpu(x, self._row_weight, self._row_bias, out_dtype)
        y = self._product(x)
        return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out] in x's dtype
        if self._onednn_weight is not None:
            return onednn_linear.onednn_linear(x, self._onednn_weight, self.bias)
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def process_weights_after_loading(model: nn.Module) -> None:
    """Every projection of ``model`` makes the weight forms its plan uses (the loader's last step)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (the pre-norm residual stream)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str,
                 ops: ModelOps | None = None) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)
        # calls of up to this many rows run as one C call (kernels.cpu_norm, the same roundings)
        self.small_rows = kernel_rows(ops.small_rows if ops.norm is RowImpl.C else 0)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None = None,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
        if x.shape[0] <= self.small_rows:
            return rms_norm_cpu(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual  # [T, hidden], in the model dtype like the reference implementation
        residual = x
        # Normalize in float32, round to the model dtype, then scale (HF's order of roundings).
        x32 = x.float()  # [T, hidden]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, hidden]
        return self.weight * x32.to(x.dtype), residual


# ---------------------------------------------------------------------------------------------
# Rotary embedding

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of a config, transformers 5 (``rope_parameters``) or 4.x style
    (``rope_scaling`` + ``rope_theta``), as one dict with ``rope_type`` and ``rope_theta``."""
    params: Mapping[str, Any] | None = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # keyed per layer type
    legacy = getattr(config, "rope_scaling", None)
    merged: dict[str, Any] = {}
    if isinstance(legacy, Mapping):
        merged.update(legacy)
    if isinstance(params, Mapping):
        merged.update(params)
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    if merged.get("rope_theta") is None:
        merged["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return merged


def rope_max_position(config: Any) -> int:
    """How many positions the rotary table must cover: the trained length, stretched by the
    factor for the scalings whose config states the pre-scaling length (linear, dynamic)."""
    base = config.max_position_embeddings
    params = rope_parameters(config)
    factor = params.get("factor") or 1.0
    if params["rope_type"] in ("linear", "dynamic") and factor > 1:
        return int(base * factor)
    return base


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves of each head) from a cos/sin table.

    The table holds every position up to ``max_position`` in float32, computed once; a forward
    looks up the step's positions once (``cos_sin``) and every layer reuses the result.

    Scalings (``rope_type``): default; linear (positions divided by ``factor``); llama3 (Llama 3.1:
    low frequencies divided by ``factor``, high ones kept, a smooth ramp between); dynamic NTK
    (past the trained length the base grows with the sequence length). Dynamic is applied per
    position: position p uses the frequencies for a sequence of length p + 1. That equals
    HF's result for any sequence within the trained length and for each token HF generates one at a
    time; HF's prefill of a prompt longer than the trained length instead rotates every position
    with the whole prompt's base, which no KV cache can reproduce once the sequence grows.
    """

    def __init__(
        self,
        head_dim: int,
        params: Mapping[str, Any],
        *,
        max_position: int,
        trained_max_position: int,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        self.head_dim = head_dim
        base = float(params["rope_theta"])
        positions = torch.arange(max_position, dtype=torch.float32)  # [P]
        inv_freq = _inverse_frequencies(base, head_dim)  # [D/2]
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, params)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        if rope_type == "dynamic" and max_position > trained_max_position:
            factor = params["factor"]
            long_positions = positions[trained_max_position:]  # [P_long], sequences past the trained length
            seq_lens = long_positions.double() + 1  # [P_long]
            scaled_bases = base * ((factor * seq_lens / trained_max_position) - (factor - 1)) ** (
                head_dim / (head_dim - 2)
            )  # [P_long]
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim  # [D/2]
            long_inv_freq = 1.0 / (scaled_bases.float()[:, None] ** exponents[None, :])  # [P_long, D/2]
            freqs[trained_max_position:] = long_positions[:, None] * long_inv_freq  # [P_long, D/2]
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)  # [P, D/2]
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)  # [P, D/2]

    def cos_sin(
        self,
        positions: torch.Tensor,  # [T]
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (cos [T, 1, D], signed sin [T, 1, D])
        cos = self.cos_cache.index_select(0, positions)  # [T, D/2]
        sin = self.sin_cache.index_select(0, positions)  # [T, D/2]
        cos = torch.cat((cos, cos), dim=-1).to(dtype)  # [T, D]
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: one roll instead of split + neg + cat
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [T, D]
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(
        self,
        x: torch.Tensor,  # [T, num_heads, D] (may be a strided view)
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D] signed
    ) -> torch.Tensor:  # [T, num_heads, D], contiguous
        rotated = torch.roll(x, self.head_dim // 2, dims=-1)  # [T, num_heads, D] = [x2, x1]
        return torch.addcmul(x * cos, rotated, sin)


def _inverse_frequencies(base: float, head_dim: int) -> torch.Tensor:  # [D/2] float32
    # Computed in float32 exactly as the reference implementation does, so positions agree bitwise.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base ** exponents)


def _llama3_frequencies(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    trained = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # [D/2]
    long_wavelength = trained / low_freq_factor  # slower than this: fully interpolated
    short_wavelength = trained / high_freq_factor  # faster than this: untouched
    # Between the two: blend interpolated and original frequencies by how many rotations fit.
    ramp = (trained / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - ramp) * inv_freq / factor + ramp * inv_freq
    out = torch.where(wavelength > long_wavelength, inv_freq / factor, inv_freq)
    is_middle = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(is_middle, blended, out)
