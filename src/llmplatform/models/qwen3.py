"""Qwen3 dense: the Llama blocks (``models.llama``) with an RMSNorm over each head of q and of k
before rotary, no q/k/v bias, and a ``head_dim`` from the config (128 for every Qwen3 size, which
is not hidden / heads for most of them). One layer:

    h ─┬─ RMSNorm ─ qkv_proj ─ q_norm(q), k_norm(k) per head ─ rotary(q, k) ─ store k, v
       │            ─ paged_attention ─ o_proj ─(+)─> h'
       └──────────────────── residual ─────────┘
    h'─ as in Llama (RMSNorm, SwiGLU MLP, residual)

Checkpoint names are Llama's plus ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``
([head_dim] each, the same on every tensor-parallel rank).
"""

from __future__ import annotations

from llmplatform.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
