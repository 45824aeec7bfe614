"""Mixtral (8x7B, 8x22B): the Llama blocks (``models.llama``: grouped-query attention, no biases)
with every layer's MLP a routed block of ``num_local_experts`` SwiGLU experts (``models.moe``). One
layer:

    h ─┬─ RMSNorm ─ attention as in Llama ─(+)─> h'
    h'─┬─ RMSNorm ─ router: softmax over the experts, top ``num_experts_per_tok``, renormalised
       │            ─ experts (tokens grouped per expert) ─ weighted sum ─(+)─> next layer
       └───────────────────────── residual ───────────────────────────┘

The routing weights stay in float32 until they scale the experts' outputs, as in transformers.
Checkpoint names: Llama's, with ``block_sparse_moe.gate`` (the router) and per-expert
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), stacked by the loader.
A ``sliding_window`` applies to every layer, as in Mistral (``models.llama.layer_windows``); the
released Mixtral configs set none.
"""

from __future__ import annotations

import torch
from torch import nn

from llmplatform.kernels.ops import ModelOps
from llmplatform.models.moe import MoeForCausalLM, Routing, SparseMoeBlock
from llmplatform.models.parallel import ShardGroup


class MixtralForCausalLM(MoeForCausalLM):
    def make_mlp(self, layer_index: int, *, dtype: torch.dtype, device: torch.device | str,
                 shard: ShardGroup | None, ops: ModelOps) -> nn.Module | None:
        config = self.config
        routing = Routing(top_k=config.num_experts_per_tok, renormalize=True, round_weights=False)
        return SparseMoeBlock(config, routing, num_experts=config.num_local_experts,
                              intermediate_size=config.intermediate_size, dtype=dtype, device=device,
                              shard=shard, ops=ops)
