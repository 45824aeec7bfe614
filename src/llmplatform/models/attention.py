"""The attention block of the Llama-style families: grouped-query attention over the paged KV
cache, with the projections, rotary, the K/V store and the attention backend the model's plan
(``kernels.ops.ModelOps``) names, and the config readings its shapes come from. Composed by
``models.llama`` (and through it Qwen2/3, Phi-3, Mixtral) and by ``models.gemma``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmplatform.kernels import AttentionMetadata, fused_decode_attention, paged_attention, store_kv_cache
from llmplatform.kernels.ops import ModelOps, RowImpl
from llmplatform.models.layers import RMSNorm, kernel_rows, reference_ops
from llmplatform.models.parallel import ShardGroup, column_linear, row_linear
from llmplatform.models.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o): Qwen2 always biases q/k/v only; Llama/Mistral follow
    ``attention_bias`` for all four."""
    if getattr(config, "model_type", None) == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


class LlamaAttention(nn.Module):
    """Grouped-query attention over the paged cache. ``qk_norm``: an RMSNorm over each head of q
    and of k (one ``head_dim`` weight each, shared by all heads) before rotary (Qwen3; Gemma 3's
    scale by ``1 + w``: ``unit_offset_norm``). ``head_dim`` is the config's, which may differ from
    hidden / heads. ``sliding_window``: each query sees its last that many positions only (None:
    all). ``scale``: of q.k (default ``head_dim ** -0.5``); ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2)."""

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str,
                 shard: ShardGroup | None = None, ops: ModelOps | None = None, qk_norm: bool = False,
                 sliding_window: int | None = None, unit_offset_norm: bool = False,
                 scale: float | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        ops = ops or reference_ops(dtype, device)
        num_ranks = 1 if shard is None else shard.size
        self.num_heads = config.num_attention_heads // num_ranks
        self.num_kv_heads = num_kv_heads_of(config) // num_ranks
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        qkv_bias, o_bias = _attention_biases(config)
        # The whole model's sizes: a sharded projection keeps its rank's share of each.
        q_size = config.num_attention_heads * self.head_dim
        kv_size = num_kv_heads_of(config) * self.head_dim
        self.qkv_proj = column_linear(
            shard, config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias, dtype=dtype, device=device,
            ops=ops,
        )
        self.o_proj = row_linear(shard, q_size, config.hidden_size, bias=o_bias, dtype=dtype, device=device,
                                 ops=ops)
        self.backend = ops.attention
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device, ops=ops,
                                  unit_offset=unit_offset_norm)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype=dtype, device=device, ops=ops,
                                  unit_offset=unit_offset_norm)
        # Decode-only steps of up to this many tokens run rotary, the K/V store and attention as
        # one fused call (kernels.fused_decode_attention); never (-1) on the eager path, nor with
        # q/k norms, which that call has no place for (they come before its rotary).
        fused = ops.rotary is RowImpl.C and not qk_norm
        self.fused_rows = kernel_rows(ops.row_op_rows if fused else 0)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        k_cache, v_cache = kv_cache  # [num_blocks, block_size, Hkv, D] each
        if num_tokens <= self.fused_rows:
            fused = fused_decode_attention(qkv, cos, sin, k_cache, v_cache, attn_metadata, H, self.scale,
                                           sliding_window=self.sliding_window, softcap=self.softcap)
            if fused is not None:  # [T, H, D] fp32
                return self.o_proj(fused.view(num_tokens, H * D), out_dtype=x.dtype)  # [T, hidden]
        qk = qkv[:, : (H + Hkv) * D].view(num_tokens, H + Hkv, D)  # [T, H + Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q_normed, _ = self.q_norm(qk[:, :H].reshape(num_tokens * H, D))  # [T * H, D]
            k_normed, _ = self.k_norm(qk[:, H:].reshape(num_tokens * Hkv, D))  # [T * Hkv, D]
            qk = torch.cat((q_normed.view(num_tokens, H, D), k_normed.view(num_tokens, Hkv, D)), dim=1)
        # q and k sit next to each other: rotate both with one set of ops.
        qk = rotary(qk, cos, sin)  # [T, H + Hkv, D]
        q = qk[:, :H]  # [T, H, D]
        k = qk[:, H:]  # [T, Hkv, D]
        v = qkv[:, (H + Hkv) * D :].view(num_tokens, Hkv, D)  # [T, Hkv, D]
        store_kv_cache(k, v, k_cache, v_cache, attn_metadata.slot_mapping, backend=self.backend)
        out = paged_attention(q, k, v, k_cache, v_cache, attn_metadata, self.scale,
                              backend=self.backend, sliding_window=self.sliding_window,
                              softcap=self.softcap)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, H * D))  # [T, hidden]
