"""The decode step's attention prologue on CPU (``csrc/rotary_store.c``): rotary on q and k, k and v
into their cache slots, q out in fp32 for the decode-attention kernel, in one C call per layer
(the fused decode path; ``kernels.fused_decode_attention`` is the entry point models use)."""

from __future__ import annotations

import ctypes

import torch

from llmplatform.kernels import cbuild

_pointer, _i64 = ctypes.c_void_p, ctypes.c_int64
kernel = cbuild.LazyFunction(
    "rotary_store.c", "rotary_store",
    [_pointer] * 7 + [_i64, _i64, _i64, _i64, ctypes.c_int], None, "CPU rotary-and-store kernel")
available = kernel.available


def supports(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    return (qkv.device.type == "cpu" and qkv.dtype in (torch.bfloat16, torch.float32)
            and qkv.dtype == cos.dtype == k_cache.dtype and qkv.is_contiguous() and cos.is_contiguous()
            and k_cache.is_contiguous() and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())


def rotary_store_cpu(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D] contiguous
    cos: torch.Tensor,  # [T, 1, D] (or [T, D]) contiguous, qkv's dtype
    sin: torch.Tensor,  # same, signed (see models.rope.RotaryEmbedding.cos_sin)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor,  # same
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
) -> torch.Tensor:  # q [T, H, D] fp32, rotated
    function = kernel()
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or cos.numel() != num_tokens * head_dim \
            or sin.shape != cos.shape or slot_mapping.shape != (num_tokens,) or head_dim % 2:
        raise ValueError("rotary_store_cpu: shapes do not match")
    if not supports(qkv, cos, k_cache, slot_mapping) or not (sin.is_contiguous() and v_cache.is_contiguous()
                                                             and v_cache.dtype == k_cache.dtype
                                                             and sin.dtype == cos.dtype):
        raise ValueError("rotary_store_cpu: unsupported dtypes or layout")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    function(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
             slot_mapping.data_ptr(), q.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim,
             int(qkv.dtype == torch.bfloat16))
    return q
