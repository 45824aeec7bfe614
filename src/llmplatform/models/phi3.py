"""Phi-3 (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini): the Llama blocks (``models.llama``) with
rotary over the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75; the rest passes
through) and, for the long-context checkpoints, LongRoPE scaling (``models.rope``). No biases, a
SiLU-gated MLP. One layer:

    h ─┬─ RMSNorm ─ qkv_proj ─ rotary(first R dims of q, k) ─ store k, v ─ paged_attention
       │            ─ o_proj ─(+)─> h'
       └────────────────────── residual ───┘
    h'─ as in Llama (RMSNorm, gate_up_proj, silu(gate) * up, down_proj, residual)

The checkpoint stores the projections fused already, ``self_attn.qkv_proj`` ([q; k; v] rows) and
``mlp.gate_up_proj`` ([gate; up] rows): our fused projections' layout, which the loader
(``models.loader``) fills shard by shard (each tensor-parallel rank its heads' rows of each).
The C rotary kernel rotates whole heads, so the ops plan keeps rotary, and with it the fused
decode attention, on torch for a partial-rotary model (``kernels.ops.resolve_ops``).
"""

from __future__ import annotations

from llmplatform.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    partial_rotary = True
