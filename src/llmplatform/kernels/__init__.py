"""Attention and KV-cache ops: the one dispatch point between the model and its kernels.

Models call ``store_kv_cache`` and ``paged_attention`` from here and nothing else, with the
backend their ``ModelOps`` names (``kernels.ops``: chosen once, when the model is built). Each op
checks its arguments once, then runs that backend:

- ``triton``: the Triton kernels (``triton_store_kv``, ``triton_decode_attention``,
  ``triton_prefill_attention``), the default for CUDA when Triton is installed;
- ``cpu``: the torch path with the decode rows done by a C kernel that reads the paged cache in
  place (``cpu_decode``, built on first use with the system C compiler), the default for CPU
  where that kernel builds;
- ``torch``: the torch reference (``cache_ops``, ``attention``), the default everywhere else.

``LLMPLATFORM_ATTENTION_BACKEND=triton|cpu|torch`` (``BACKEND_ENV_VAR``) forces one; the engine's
config reads it (``engine.config.ModelConfig.attention_backend``), never these ops. Forcing
``triton`` for CPU tensors only works under the Triton interpreter (``TRITON_INTERPRET=1``, which
Triton reads when the kernel modules are imported); the launchers say so if it is missing.

Triton is imported lazily: ``import llmplatform.kernels`` works without it.
"""

from __future__ import annotations

import os

import torch

from llmplatform.kernels import cpu_decode, cpu_rotary
from llmplatform.kernels.attention import check_paged_attention_args, paged_attention_torch
from llmplatform.kernels.cache_ops import check_store_kv_cache_args, store_kv_cache_torch
from llmplatform.kernels.metadata import AttentionMetadata
from llmplatform.kernels.ops import AttentionBackend, triton_installed

BACKEND_ENV_VAR = "LLMPLATFORM_ATTENTION_BACKEND"

# Triton fuses float multiply-adds unless told otherwise, warns at the first launch that its
# default turns to "off" in 3.10, and reads this setting at every launch. Our kernels are checked
# against the torch reference with fusion on: keep it on whatever the Triton version (a value the
# user set wins).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def attention_backend(device: torch.device) -> AttentionBackend:
    """The default backend for tensors on ``device`` (what ``ops.resolve_ops`` picks for
    ``auto``): Triton for CUDA where installed, the C decode kernel for CPU where it builds,
    else torch."""
    if device.type == "cuda" and triton_installed():
        return AttentionBackend.TRITON
    if device.type == "cpu" and cpu_decode.available():
        return AttentionBackend.CPU
    return AttentionBackend.TORCH


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 flat slots
    *,
    backend: AttentionBackend,
) -> None:
    """Write each token's K/V into ``slot = block_id * block_size + offset`` of the caches."""
    check_store_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)
    if backend is AttentionBackend.TRITON:
        from llmplatform.kernels.triton_store_kv import store_kv_cache_triton

        store_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    *,
    backend: AttentionBackend,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of the new tokens over cached prefix + themselves (K/V already stored).

    ``sliding_window`` W: a query at position p sees keys ``p - W < j <= p`` only (W keys, itself
    included), and cache blocks wholly before that are never read (their table entries may name
    freed blocks). ``softcap`` c: scores ``c * tanh(q.k * scale / c)`` before masking and softmax.
    None turns either off."""
    check_paged_attention_args(query, key, value, k_cache, v_cache, metadata)
    check_window_args(sliding_window, softcap)
    if backend is AttentionBackend.TRITON:
        return paged_attention_triton(query, key, value, k_cache, v_cache, metadata, scale,
                                      sliding_window=sliding_window, softcap=softcap)
    if backend is AttentionBackend.CPU:
        if query.device.type != "cpu":
            raise ValueError(f"attention backend cpu: tensors are on {query.device}, not the CPU")
        decode_kernel = cpu_decode.paged_decode_attention_cpu if cpu_decode.supports(query, k_cache) else None
        return paged_attention_torch(query, key, value, k_cache, v_cache, metadata, scale, decode_kernel,
                                     sliding_window=sliding_window, softcap=softcap)
    return paged_attention_torch(query, key, value, k_cache, v_cache, metadata, scale,
                                 sliding_window=sliding_window, softcap=softcap)


def check_window_args(sliding_window: int | None, softcap: float | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")


def fused_decode_attention(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim] signed
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    num_heads: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim] float32, or None
    """A decode-only CPU step's rotary, K/V store and attention as two C calls (``cpu_rotary``,
    then ``cpu_decode`` over the fp32 query it wrote): the fused decode path's per-layer attention.
    None when it does not apply to this step (not decode-only, a layout or dtype
    the kernels do not take): the caller then runs the separate ops (``store_kv_cache``,
    ``paged_attention`` with the ``cpu`` backend), which give the same result. Only a model
    whose ops run the ``cpu`` backend calls it (``ModelOps.rotary``); what is checked here is the
    step's shape and the tensors' layout. ``sliding_window`` and ``softcap`` as in
    ``paged_attention``."""
    check_window_args(sliding_window, softcap)
    if not metadata.is_decode_only or not cpu_rotary.supports(qkv, cos, k_cache, metadata.slot_mapping):
        return None
    if metadata.num_tokens != qkv.shape[0] or not cpu_decode.supports_heads(num_heads, k_cache):
        return None
    query = cpu_rotary.rotary_store_cpu(qkv, cos, sin, k_cache, v_cache, metadata.slot_mapping, num_heads)
    return cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, metadata.block_tables,
                                                 metadata.seq_lens, scale, sliding_window=sliding_window,
                                                 softcap=softcap)


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (already in the cache: unused)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (already in the cache: unused)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``paged_attention_torch``'s signature on the Triton kernels.

    A decode-only batch (one query row per sequence, the common step) goes to the decode kernel,
    with split-K for long contexts; any batch with a longer query goes whole to the prefill
    kernel, which handles query length 1 like any other (mixed steps are rarer, and one launch
    keeps the dispatch simple).
    """
    if metadata.is_decode_only:
        from llmplatform.kernels.triton_decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(
            query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len, scale,
            sliding_window=sliding_window, softcap=softcap,
        )
    from llmplatform.kernels.triton_prefill_attention import paged_prefill_attention_triton

    return paged_prefill_attention_triton(
        query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
        metadata.max_query_len, scale, sliding_window=sliding_window, softcap=softcap,
    )


def check_triton_launch(kernel: object, **tensors: torch.Tensor) -> bool:
    """Launcher check shared by the Triton kernel files: all ``tensors`` on one device that
    ``kernel`` can run on. Returns whether the kernel runs in Triton's interpreter.

    Compiled Triton kernels need CUDA tensors. The interpreter runs on CPU tensors; it is chosen
    per kernel when its module is imported, from ``TRITON_INTERPRET``.
    """
    from triton.runtime.interpreter import InterpretedFunction

    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    device = next(iter(devices.values()))
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, got {device}: for CPU tensors set TRITON_INTERPRET=1 "
            f"before the kernel modules are imported, or use {BACKEND_ENV_VAR}=torch"
        )
    return interpreted


__all__ = [
    "BACKEND_ENV_VAR",
    "AttentionBackend",
    "AttentionMetadata",
    "attention_backend",
    "check_triton_launch",
    "fused_decode_attention",
    "paged_attention",
    "paged_attention_triton",
    "store_kv_cache",
]
