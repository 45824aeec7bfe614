"""Building blocks of the Llama family: linear layers that load fused, RMSNorm, rotary embedding.

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


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). With several ``output_sizes`` it is a fused projection: the checkpoint's
    separate matrices (q/k/v, gate/up) are stacked along the output dim, shard i at rows
    ``sum(output_sizes[:i]) ..``; one matmul replaces several, which matters on CPU."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.weight = _empty_param(sum(self.output_sizes), in_features, dtype=dtype, device=device)
        self.bias = _empty_param(sum(self.output_sizes), dtype=dtype, device=device) if bias else None
        self._onednn_weight: torch.Tensor | None = None  # see use_onednn_weights
        # see use_row_kernel: (weight as loaded, bias in fp32 or None, most rows it serves)
        self._row_kernel: tuple[torch.Tensor, torch.Tensor | None, int] | None = None

    def use_compute_dtype(self, dtype: torch.dtype) -> None:
        """Hold the weight (and bias) in ``dtype`` and multiply in it; inputs are converted to it
        and results back to the input's dtype (see ``torch_utils.resolve_compute_dtype``)."""
        if self.weight.dtype != dtype:
            self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype products run in (the weight's, plain or prepacked)."""
        return (self.weight if self._onednn_weight is None else self._onednn_weight).dtype

    def use_onednn_weight(self) -> None:
        """Replace the CPU weight by oneDNN's prepacked copy (same size and dtype): see
        ``use_onednn_weights``. ``weight`` is None afterwards."""
        self._onednn_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None

    def use_row_kernel(self, max_rows: int) -> None:
        """Products of up to ``max_rows`` input rows run on the C kernel
        (``kernels.cpu_linear``) over the weight as it is now (call before ``use_compute_dtype``:
        a bf16 weight is then kept beside its fp32 copy and streams half the bytes); more rows
        keep the other path. The fused decode path's switch (``engine.decode_path``)."""
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        self._row_kernel = (self.weight.detach().contiguous(), bias, max_rows)

    def forward(self, x: torch.Tensor,  # [T, in]
                out_dtype: torch.dtype | None = None,  # default: x's
                ) -> torch.Tensor:  # [T, sum(output_sizes)]
        if self._row_kernel is not None and x.shape[0] <= self._row_kernel[2]:
            weight, bias, _ = self._row_kernel
            return small_linear_cpu(x, weight, bias, out_dtype)
        if out_dtype is not None and out_dtype != x.dtype:
            return Linear.forward(self, x).to(out_dtype)  # not a subclass's (it may all-reduce)
        if self._onednn_weight is not None:
            dtype = self._onednn_weight.dtype
            rows = x.shape[0]
            padded = onednn_rows(rows)
            xw = x.to(dtype)
            if padded != rows:
                xw = F.pad(xw, (0, 0, 0, padded - rows))
            y = torch.ops.mkldnn._linear_pointwise(xw.contiguous(), self._onednn_weight,
                                                   self.bias, "none", [], "")[:rows]
            return y if x.dtype == dtype else y.to(x.dtype)
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


ONEDNN_LINEARS_ENV_VAR = "LLMPLATFORM_ONEDNN_LINEARS"

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
    """The weight dtypes whose CPU projections ``use_onednn_weights`` prepacks: float32, and
    bfloat16 on CPUs with bf16 matrix instructions (elsewhere oneDNN emulates bf16 and the engine
    multiplies in float32 anyway: ``torch_utils.resolve_compute_dtype``)."""
    from llmplatform.utils.torch_utils import cpu_has_native_low_precision_matmul

    if cpu_has_native_low_precision_matmul(torch.bfloat16):
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def use_onednn_weights(model: nn.Module) -> int:
    """Run every CPU projection of ``model`` (the LM head excepted) whose weight is in
    ``onednn_weight_dtypes()`` on oneDNN with its weight prepacked once; returns how many were
    switched (0: none, and why is logged).

    ``F.linear`` re-lays-out the weight on every call (float32: MKL's sgemm; bf16: oneDNN's
    matmul over a plain weight); with the few rows of a decode step that costs as much as the
    product. oneDNN's linear over a weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``,
    no extra memory: the packed copy replaces the plain one) made the engine 4-6% faster at 32
    concurrent requests in float32 on a 2-core AVX-512 Xeon, and SmolLM2's 30 layers of bf16
    projections 1.6x faster for a 32-row decode step on a 2-core AVX512-BF16 EPYC (27 -> 17 ms,
    the same bits). Results agree with ``F.linear`` to the dtype's rounding (another summation
    order); the first projection of each dtype is checked before any of that dtype is switched.
    ``LLMPLATFORM_ONEDNN_LINEARS=0`` keeps ``F.linear``.
    """
    import logging
    import os

    log = logging.getLogger("llmplatform.models")
    if os.environ.get(ONEDNN_LINEARS_ENV_VAR, "").strip().lower() in ("0", "false", "off", "no"):
        return 0
    if not torch.backends.mkldnn.is_available():
        return 0
    switched = 0
    for dtype in onednn_weight_dtypes():
        linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "lm_head"
                   and m.weight is not None and m.weight.device.type == "cpu" and m.weight.dtype == dtype]
        if not linears:
            continue
        probe = linears[0]
        original = probe.weight
        x = torch.randn(5, original.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
        expected = F.linear(x, original, probe.bias).float()
        # float32: summation order only; bf16: plus the output's rounding (8 bits of mantissa).
        rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2 * expected.abs().max().item())
        try:
            probe.use_onednn_weight()
            got = probe(x).float()
            if not torch.allclose(got, expected, rtol=rtol, atol=atol):
                raise RuntimeError(f"differs from F.linear by {(got - expected).abs().max().item():.2e}")
        except Exception as exc:  # a torch without oneDNN's packed linear, or one that misbehaves
            probe.weight, probe._onednn_weight = original, None
            log.warning("oneDNN linears unavailable for %s weights (%s): their projections use F.linear",
                        str(dtype).removeprefix("torch."), exc)
            continue
        for layer in linears[1:]:
            layer.use_onednn_weight()
        log.info("%s projections run on oneDNN with prepacked weights (%d)",
                 str(dtype).removeprefix("torch."), len(linears))
        switched += len(linears)
    return switched


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (the pre-norm residual stream)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)
        self._row_kernel_max_rows = 0  # see use_row_kernel

    def use_row_kernel(self, max_rows: int) -> None:
        """Calls with up to ``max_rows`` rows run as one C call (``kernels.cpu_norm``, the same
        roundings); the fused decode path's switch (``engine.decode_path``)."""
        self._row_kernel_max_rows = max_rows

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None = None,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
        if x.shape[0] <= self._row_kernel_max_rows:
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
