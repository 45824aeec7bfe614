"""Rotary position embeddings: the RoPE parameters of a config, the scalings (``rope_type``) and
the module that rotates q and k from a cos/sin table.

Scalings: default; linear (positions divided by ``factor``); dynamic NTK (past the trained length
the base grows with the sequence length); llama3 (Llama 3.1: low frequencies divided by
``factor``, high ones kept, a smooth ramp between); yarn (the same three bands, bounded by the
dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original length, plus an
attention factor on cos/sin); longrope (Phi-3: a per-frequency ``short_factor`` within the
original length, ``long_factor`` past it, plus an attention factor). Any of them may rotate only
the first ``partial_rotary_factor`` of each head (Phi-3, Phi-4-mini), the rest passed through.

Every formula is computed in float32 in the reference implementation's order (transformers'
``modeling_rope_utils``), so our frequencies equal its bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


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
    if merged.get("partial_rotary_factor") is None and getattr(config, "partial_rotary_factor", None) is not None:
        merged["partial_rotary_factor"] = config.partial_rotary_factor
    return merged


def rope_max_position(config: Any) -> int:
    """How many positions the rotary table must cover: the trained length, stretched by the
    factor for the scalings whose config states the pre-scaling length (linear, dynamic; yarn
    unless ``max_position_embeddings`` already is ``original_max_position_embeddings * factor``,
    as ``llm.resolve.context_length`` reads it). Llama 3 and LongRoPE configs state the extended
    length."""
    base = config.max_position_embeddings
    params = rope_parameters(config)
    factor = params.get("factor") or 1.0
    if params["rope_type"] in ("linear", "dynamic") and factor > 1:
        return int(base * factor)
    if params["rope_type"] == "yarn" and factor > 1:
        original = params.get("original_max_position_embeddings")
        return base if isinstance(original, int) and base >= original * factor else int(base * factor)
    return base


def rotary_dim_of(head_dim: int, params: Mapping[str, Any]) -> int:
    """How many leading dims of each head are rotated (all of them unless ``partial_rotary_factor``)."""
    return int(head_dim * (params.get("partial_rotary_factor") or 1.0))


def is_partial_rotary(config: Any) -> bool:
    """Whether ``config`` rotates only part of each head (what the ops plan needs to know)."""
    return (rope_parameters(config).get("partial_rotary_factor") or 1.0) < 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate the two halves of the first ``rotary_dim`` dims of each
    head; the rest pass through) from a cos/sin table.

    The table holds every position up to ``max_position`` in float32, computed once, the
    scaling's attention factor (yarn, longrope) already multiplied in; a forward looks up the
    step's positions once (``cos_sin``) and every layer reuses the result.

    Two scalings depend on the sequence length; both are applied per position, position p using
    what the reference uses for a sequence of length p + 1, because a paged KV cache keeps each
    key rotated as it was when computed and a sequence's keys cannot be re-rotated as it grows:
    - dynamic: past the trained length the base grows with p + 1;
    - longrope: positions below ``original_max_position_embeddings`` use ``short_factor``, the
      rest ``long_factor``.
    That equals HF's result for any sequence within the trained (original) length and for each
    token HF generates one at a time (HF also keeps its cached keys as computed). HF's prefill of a
    prompt longer than that length instead rotates every position with the long-sequence
    frequencies. (vLLM's Phi-3 LongRoPE, ``Phi3LongRoPEScaledRotaryEmbedding``, keeps both tables
    and moves a whole step's batch to the long one when any of its positions passes the original
    length, so a key can be rotated differently depending on what it was batched with; per
    position is a function of the position alone, whatever the batch, the chunking or a
    prefix-cache hit, so the paged cache's blocks stay valid to share.)
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
        self.rotary_dim = rotary_dim = rotary_dim_of(head_dim, params)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary dims {rotary_dim} of a {head_dim}-dim head: must be even and in (0, {head_dim}]")
        base = float(params["rope_theta"])
        positions = torch.arange(max_position, dtype=torch.float32)  # [P]
        inv_freq, self.attention_factor = rope_frequencies(params, rotary_dim, trained_max_position)  # [R/2]
        freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
        if rope_type == "dynamic" and max_position > trained_max_position:
            factor = params["factor"]
            long_positions = positions[trained_max_position:]  # [P_long], sequences past the trained length
            seq_lens = long_positions + 1  # [P_long]; float32 throughout, as the reference computes it
            scaled_bases = base * ((factor * seq_lens / trained_max_position) - (factor - 1)) ** (
                rotary_dim / (rotary_dim - 2)
            )  # [P_long]
            long_inv_freq = 1.0 / (scaled_bases[:, None] ** _exponents(rotary_dim)[None, :])  # [P_long, R/2]
            freqs[trained_max_position:] = long_positions[:, None] * long_inv_freq  # [P_long, R/2]
        if rope_type == "longrope":
            original = _original_max_position(params, trained_max_position)
            long_inv_freq = _longrope_frequencies(params["long_factor"], base, rotary_dim)  # [R/2]
            freqs[original:] = positions[original:, None] * long_inv_freq[None, :]  # [P - original, R/2]
        cos, sin = freqs.cos(), freqs.sin()  # [P, R/2]
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.register_buffer("cos_cache", cos.to(device), persistent=False)  # [P, R/2]
        self.register_buffer("sin_cache", sin.to(device), persistent=False)  # [P, R/2]

    @property
    def is_partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def cos_sin(
        self,
        positions: torch.Tensor,  # [T]
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (cos [T, 1, R], signed sin [T, 1, R])
        cos = self.cos_cache.index_select(0, positions)  # [T, R/2]
        sin = self.sin_cache.index_select(0, positions)  # [T, R/2]
        cos = torch.cat((cos, cos), dim=-1).to(dtype)  # [T, R]
        # rotate_half(x) * sin == roll(x, R/2) * [-sin, sin]: one roll instead of split + neg + cat
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [T, R]
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(
        self,
        x: torch.Tensor,  # [T, num_heads, D] (may be a strided view)
        cos: torch.Tensor,  # [T, 1, R]
        sin: torch.Tensor,  # [T, 1, R] signed
    ) -> torch.Tensor:  # [T, num_heads, D], contiguous
        if not self.is_partial:
            rotated = torch.roll(x, self.rotary_dim // 2, dims=-1)  # [T, num_heads, D] = [x2, x1]
            return torch.addcmul(x * cos, rotated, sin)
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]  # [T, num_heads, R], [.., D - R]
        rotated = torch.roll(x_rot, self.rotary_dim // 2, dims=-1)  # [T, num_heads, R]
        return torch.cat((torch.addcmul(x_rot * cos, rotated, sin), x_pass), dim=-1)


def rope_frequencies(params: Mapping[str, Any], rotary_dim: int,
                     trained_max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2] float32, attention factor) of the scaling at the start of a
    sequence (longrope: the short factors; dynamic: the trained base)."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if rope_type == "longrope":
        return (_longrope_frequencies(params["short_factor"], base, rotary_dim),
                _longrope_attention_factor(params, trained_max_position))
    if rope_type == "yarn":
        return _yarn_frequencies(params, base, rotary_dim, trained_max_position)
    inv_freq = 1.0 / (base ** _exponents(rotary_dim))  # [R/2]
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, params)
    return inv_freq, 1.0


def _exponents(rotary_dim: int) -> torch.Tensor:  # [R/2] float32: 2i / R
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim


def _original_max_position(params: Mapping[str, Any], trained_max_position: int) -> int:
    return params.get("original_max_position_embeddings") or trained_max_position


def _llama3_frequencies(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    trained = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq  # [R/2]
    long_wavelength = trained / low_freq_factor  # slower than this: fully interpolated
    short_wavelength = trained / high_freq_factor  # faster than this: untouched
    # Between the two: blend interpolated and original frequencies by how many rotations fit.
    ramp = (trained / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - ramp) * inv_freq / factor + ramp * inv_freq
    out = torch.where(wavelength > long_wavelength, inv_freq / factor, inv_freq)
    is_middle = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(is_middle, blended, out)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(params: Mapping[str, Any], base: float, rotary_dim: int,
                      trained_max_position: int) -> tuple[torch.Tensor, float]:
    original = _original_max_position(params, trained_max_position)
    factor = params.get("factor") or trained_max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32  # rotations over the original length: above, extrapolate
    beta_slow = params.get("beta_slow") or 1  # below, interpolate (divide by factor)

    def dim_turning(num_rotations: float) -> float:  # the (fractional) dim pair that turns this often
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-dim ramp would divide by zero
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [R/2]
    extrapolation_weight = 1 - ramp  # [R/2]: 1 for the fast dims (kept), 0 for the slow (interpolated)
    pos_freqs = base ** _exponents(rotary_dim)  # [R/2]
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_frequencies(ext_factors: Any, base: float, rotary_dim: int) -> torch.Tensor:  # [R/2]
    factors = torch.tensor(ext_factors, dtype=torch.float32)  # [R/2]
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"longrope factors: {factors.shape[0]} given, {rotary_dim // 2} rotary frequencies")
    return 1.0 / (factors * base ** _exponents(rotary_dim))


def _longrope_attention_factor(params: Mapping[str, Any], trained_max_position: int) -> float:
    original = _original_max_position(params, trained_max_position)
    factor = params.get("factor") or trained_max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        return float(attention_factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
