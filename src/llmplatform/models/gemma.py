"""Gemma 2 and Gemma 3 (text): the Llama blocks (``models.llama``) with Gemma's options. One layer:

    h ─┬─ RMSNorm ─ qkv_proj ─ [Gemma 3: q_norm(q), k_norm(k) per head] ─ rotary(q, k) ─ store k, v
       │            ─ paged_attention (scale query_pre_attn_scalar ** -0.5, [Gemma 2: softcap],
       │              window on sliding layers) ─ o_proj ─ RMSNorm ─(+)─> h'
       └────────────────────────────── residual ─────────────────────┘
    h'─┬─ RMSNorm ─ gate_up_proj ─ gelu_tanh(gate) * up ─ down_proj ─ RMSNorm ─(+)─> next layer
       └──────────────────────────── residual ───────────────────────────┘

- every norm (the four per layer, the final one, Gemma 3's q/k norms) scales by ``1 + w`` in
  float32 (``RMSNorm(unit_offset=True)``); the norms after attention and after the MLP take no
  residual, so the residual add happens in the next pre-norm, as in Llama;
- the embeddings are multiplied by sqrt(hidden), that factor first rounded to the model dtype
  (transformers' ``Gemma*TextScaledWordEmbedding``: 55.4256 becomes 55.5 in bf16);
- ``layer_types`` says per layer ``sliding_attention`` (keys within ``sliding_window`` of the
  query: p - W < j <= p) or ``full_attention``; Gemma 2 alternates them, Gemma 3 has five local
  layers to a global one;
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``) and both families the final
  logits (``final_logit_softcapping``, set in Gemma 2 checkpoints): ``cap * tanh(x / cap)``.
  Gemma 3 ignores an attention softcap its config may carry, as transformers' Gemma 3 does;
- Gemma 3's rope is per layer type (``rope_parameters`` keyed by ``sliding_attention`` /
  ``full_attention``: local layers base 10k unscaled, global ones base 1M with the checkpoint's
  scaling); Gemma 2 has one table for all layers.

Checkpoint names are Llama's plus ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``
(and Gemma 3's ``self_attn.q_norm`` / ``k_norm``); the embeddings are tied (no ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from llmplatform.kernels import AttentionMetadata
from llmplatform.kernels.ops import ModelOps
from llmplatform.models.layers import RMSNorm, reference_ops
from llmplatform.models.attention import KVCache, LlamaAttention, head_dim_of
from llmplatform.models.llama import LlamaForCausalLM, LlamaMLP, layer_windows
from llmplatform.models.parallel import ShardGroup, vocab_embedding
from llmplatform.models.rope import RotaryEmbedding, rope_parameters

SLIDING = "sliding_attention"
FULL = "full_attention"


def rope_parameters_by_layer_type(config: Any) -> dict[str, dict[str, Any]]:
    """The rope parameters of each layer type: Gemma 3 keys them by layer type, Gemma 2 has one set."""
    params = getattr(config, "rope_parameters", None)
    if not (isinstance(params, Mapping) and SLIDING in params):
        one = rope_parameters(config)
        return {SLIDING: one, FULL: one}
    # transformers' Gemma3TextConfig has filled each type's rope_theta (from rope_local_base_freq
    # and rope_theta of older configs) and put any legacy rope_scaling into full_attention's.
    by_type = {kind: dict(params[kind]) for kind in (SLIDING, FULL)}
    for one in by_type.values():
        one["rope_type"] = one.get("rope_type") or one.get("type") or "default"
    return by_type


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_type: str, window: int | None, *, dtype: torch.dtype,
                 device: torch.device | str, shard: ShardGroup | None, ops: ModelOps, qk_norm: bool,
                 attention_softcap: bool, mlp: nn.Module | None = None) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps

        def norm() -> RMSNorm:
            return RMSNorm(size, eps, dtype=dtype, device=device, ops=ops, unit_offset=True)

        self.layer_type = layer_type
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(
            config, dtype=dtype, device=device, shard=shard, ops=ops, qk_norm=qk_norm, unit_offset_norm=True,
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=config.attn_logit_softcapping if attention_softcap else None,
            sliding_window=window,
        )
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp if mlp is not None else LlamaMLP(config, dtype=dtype, device=device, shard=shard, ops=ops,
                                                        activation=config.hidden_activation)
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] the previous layer's output (before its residual add)
        residual: torch.Tensor | None,  # [T, hidden] the residual stream; None at layer 0
        cos: torch.Tensor,  # [T, 1, head_dim] of this layer's rope table
        sin: torch.Tensor,  # [T, 1, head_dim]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (post-MLP-normed output [T, hidden], residual [T, hidden])
        x, residual = self.input_layernorm(x, residual)  # [T, hidden] each
        x = self.self_attn(x, cos, sin, rotary, kv_cache, attn_metadata)  # [T, hidden]
        x, _ = self.post_attention_layernorm(x)  # [T, hidden], no residual: it is added next
        x, residual = self.pre_feedforward_layernorm(x, residual)  # [T, hidden] each
        x, _ = self.post_feedforward_layernorm(self.mlp(x))  # [T, hidden]
        return x, residual


class Gemma2Model(nn.Module):
    """The Gemma network under the LM head (``LlamaForCausalLM.decoder_class``)."""

    attention_softcap = True
    """Whether attention scores are soft-capped by ``attn_logit_softcapping`` (Gemma 2 only)."""

    def __init__(
        self, config: Any, *, dtype: torch.dtype, device: torch.device | str, max_position: int,
        shard: ShardGroup | None = None, ops: ModelOps | None = None, qk_norm: bool = False,
        make_mlp: Callable[[int], nn.Module | None] | None = None,  # layer index -> its MLP (None: dense GeGLU)
    ) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        self.embed_tokens = vocab_embedding(shard, config.vocab_size, config.hidden_size, dtype=dtype,
                                            device=device)
        # float32 first, then the model dtype: the reference's two roundings of sqrt(hidden)
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("normalizer", normalizer.to(device), persistent=False)
        # transformers' configs fill layer_types (from an older config's sliding_window_pattern)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, layer_type, window, dtype=dtype, device=device, shard=shard, ops=ops,
                              qk_norm=qk_norm, attention_softcap=self.attention_softcap,
                              mlp=None if make_mlp is None else make_mlp(index))
            for index, (layer_type, window) in enumerate(zip(config.layer_types, layer_windows(config), strict=True))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device, ops=ops,
                            unit_offset=True)
        rope_by_type = rope_parameters_by_layer_type(config)
        tables: dict[str, RotaryEmbedding] = {}  # Gemma 2: one table under both names
        for kind, params in rope_by_type.items():
            same = next((table for other, table in tables.items() if rope_by_type[other] == params), None)
            tables[kind] = same or RotaryEmbedding(
                head_dim_of(config), params, max_position=max_position,
                trained_max_position=config.max_position_embeddings, device=device)
        self.rotary_tables = nn.ModuleDict(tables)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids) * self.normalizer  # [T, hidden]
        cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per distinct table, once per step
        for table in self.rotary_tables.values():
            if id(table) not in cos_sin:
                cos_sin[id(table)] = table.cos_sin(positions, x.dtype)  # [T, 1, head_dim] each
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            table = self.rotary_tables[layer.layer_type]
            cos, sin = cos_sin[id(table)]
            x, residual = layer(x, residual, cos, sin, table, kv_cache, attn_metadata)
        x, _ = self.norm(x, residual)  # [T, hidden]
        return x


class Gemma3TextModel(Gemma2Model):
    attention_softcap = False  # transformers' Gemma3Attention passes no softcap to its attention


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; the final logits soft-capped by ``final_logit_softcapping`` when the config sets it."""

    decoder_class = Gemma2Model
    hidden_act_field = "hidden_activation"

    def __init__(self, config: Any, *, max_model_len: int | None = None, **kwargs: Any) -> None:
        # Gemma 3's max_position_embeddings is its context length with the rope scaling applied
        # (131072 for linear x8), not the pre-scaling length a Llama's linear scaling stretches.
        limit = config.max_position_embeddings
        super().__init__(config, max_model_len=limit if max_model_len is None else min(limit, max_model_len),
                         **kwargs)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab rows]
        logits = super()._local_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        # elementwise, so each tensor-parallel rank caps its slice before the gather
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (1B, or the language model of a multimodal checkpoint saved on its own)."""

    decoder_class = Gemma3TextModel
    qk_norm = True
