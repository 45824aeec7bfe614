"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (``models.qwen3``: per-head q/k
RMSNorm before rotary, ``head_dim`` from the config) with routed SwiGLU experts (``models.moe``)
as the MLP of its sparse layers. One layer:

    h ─┬─ RMSNorm ─ attention as in Qwen3 ─(+)─> h'
    h'─┬─ RMSNorm ─ router: softmax over ``num_experts``, top ``num_experts_per_tok`` (divided by
       │            their sum when ``norm_topk_prob``) ─ experts of ``moe_intermediate_size`` columns
       │            (tokens grouped per expert) ─ weighted sum ─(+)─> next layer
       └───────────────────────── residual ───────────────────────────┘

A layer is sparse unless it is listed in ``mlp_only_layers`` or ``(index + 1)`` is not a multiple of
``decoder_sparse_step``; the others keep a dense SwiGLU MLP of ``intermediate_size`` columns (the
released checkpoints: every layer sparse). The routing weights are rounded to the model dtype
before they scale the experts' outputs, as in transformers. Checkpoint names: Qwen3's, with
``mlp.gate`` (the router) and per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, stacked
by the loader.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmplatform.kernels.ops import ModelOps
from llmplatform.models.moe import MoeForCausalLM, Routing, SparseMoeBlock
from llmplatform.models.parallel import ShardGroup


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Whether layer ``layer_index`` routes to experts (transformers' ``Qwen3MoeDecoderLayer`` rule)."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    def make_mlp(self, layer_index: int, *, dtype: torch.dtype, device: torch.device | str,
                 shard: ShardGroup | None, ops: ModelOps) -> nn.Module | None:
        config = self.config
        if not is_sparse_layer(config, layer_index):
            return None  # the dense MLP
        routing = Routing(top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                          round_weights=True)
        return SparseMoeBlock(config, routing, num_experts=config.num_experts,
                              intermediate_size=config.moe_intermediate_size, dtype=dtype, device=device,
                              shard=shard, ops=ops)
