"""store_kv_cache in Triton: write the new tokens' K and V into their slots of the paged cache.

Cache layout, per layer (see ``cache_ops``):

    k_cache[num_blocks, block_size, num_kv_heads, head_dim], flat slot = block_id * block_size + offset

so slot ``s`` is the contiguous run of ``num_kv_heads * head_dim`` elements starting at
``s * num_kv_heads * head_dim``. One program per token copies its [num_kv_heads, head_dim] tile
of K and of V there; key/value may be strided views (the model slices them out of one qkv
projection). No arithmetic touches the values, so every dtype is a plain copy.

``store_kv_cache_torch`` (re-exported below as ``store_kv_cache_reference``) is the reference with
the same signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplatform.kernels import check_triton_launch
from llmplatform.kernels.cache_ops import check_store_kv_cache_args, store_kv_cache_torch

store_kv_cache_reference = store_kv_cache_torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], any strides
    value_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM], any strides
    k_cache_ptr,  # [num_blocks * block_size, NUM_KV_HEADS * HEAD_DIM], contiguous
    v_cache_ptr,  # same
    slot_mapping_ptr,  # [num_tokens] int32/int64
    key_stride_token,
    key_stride_head,
    key_stride_dim,
    value_stride_token,
    value_stride_head,
    value_stride_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,  # powers of two, for tl.arange
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: slot * row can pass 2**31

    heads = tl.arange(0, NUM_KV_HEADS_PADDED)  # [Hp]
    dims = tl.arange(0, HEAD_DIM_PADDED)  # [Dp]
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]  # [Hp, Dp]

    key = tl.load(
        key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :] * key_stride_dim,
        mask=mask,
    )  # [Hp, Dp]
    value = tl.load(
        value_ptr + token * value_stride_token + heads[:, None] * value_stride_head
        + dims[None, :] * value_stride_dim,
        mask=mask,
    )  # [Hp, Dp]
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]  # [Hp, Dp]
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 flat slots
) -> None:
    """Launcher: checks the arguments, then one program per token."""
    check_store_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)
    if key.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"store_kv_cache_triton supports {SUPPORTED_DTYPES}, got {key.dtype}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    check_triton_launch(_store_kv_cache_kernel, key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                        slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )
