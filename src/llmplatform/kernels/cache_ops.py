"""store_kv_cache: write each new token's key and value into its slot of the paged KV cache.

Cache layout, per layer (one tensor for K, one for V):

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
            \\_____ flat slot = block_id * block_size + offset _____/

so ``k_cache.view(num_blocks * block_size, num_kv_heads * head_dim)`` has one row per slot.
"""

from __future__ import annotations

import torch


def check_store_kv_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Shape/dtype/device checks shared by every implementation (the launcher's half)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != key's {tuple(key.shape[1:])}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise TypeError(f"key/value dtype {key.dtype} must match the cache dtype {k_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def store_kv_cache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Torch reference: one index_copy_ per cache into its [num_slots, num_kv_heads * head_dim] view."""
    num_tokens = key.shape[0]
    row = k_cache.shape[2] * k_cache.shape[3]  # num_kv_heads * head_dim
    slots = slot_mapping.long()  # [num_tokens]
    k_cache.view(-1, row).index_copy_(0, slots, key.reshape(num_tokens, row))
    v_cache.view(-1, row).index_copy_(0, slots, value.reshape(num_tokens, row))
