"""Attention and KV-cache ops: the one dispatch point between the model and its kernels.

Models call ``store_kv_cache`` and ``paged_attention`` from here and nothing else. Each op checks
its arguments once, then runs the implementation registered for the tensors' device type; the
torch reference serves any device that has none. A Triton implementation for CUDA is one entry
in each table below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmplatform.kernels.attention import check_paged_attention_args, paged_attention_torch
from llmplatform.kernels.cache_ops import check_store_kv_cache_args, store_kv_cache_torch
from llmplatform.kernels.metadata import AttentionMetadata

# device type ("cpu", "cuda", ...) -> implementation with the public op's signature
_STORE_KV_CACHE: dict[str, Callable[..., None]] = {}
_PAGED_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {}


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 flat slots
) -> None:
    """Write each token's K/V into ``slot = block_id * block_size + offset`` of the caches."""
    check_store_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)
    _STORE_KV_CACHE.get(key.device.type, store_kv_cache_torch)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of the new tokens over cached prefix + themselves (K/V already stored)."""
    check_paged_attention_args(query, key, value, k_cache, v_cache, metadata)
    impl = _PAGED_ATTENTION.get(query.device.type, paged_attention_torch)
    return impl(query, key, value, k_cache, v_cache, metadata, scale)


__all__ = ["AttentionMetadata", "paged_attention", "store_kv_cache"]
