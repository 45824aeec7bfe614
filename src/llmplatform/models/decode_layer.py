"""Which Llama-family decoder layers run a decode step as one C call, and the call's arguments
(``kernels.cpu_decode_layer``).

The plan says whether the kernel may run (``ModelOps.layer``, decided at build from what builds
here); a layer qualifies when it is the plain pre-norm layer the kernel computes: the fused
attention (``LlamaAttention.fused_rows``: C rotary, no q/k norms), the dense SwiGLU MLP on the C
activation, C norms without Gemma's unit offset, and four unsharded, unquantized, unadapted
``Linear`` projections. ``describe`` answers once, after loading; ``attach_lora`` takes the
answer back from a layer whose projections it wraps (an adapter's product is not in the call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from llmplatform.kernels.cpu_decode_layer import DecodeLayerWeights, LayerTensors, describe_layer
from llmplatform.kernels.ops import RowImpl
from llmplatform.models.layers import Linear

if TYPE_CHECKING:
    from llmplatform.models.llama import LlamaDecoderLayer


def describe(layer: LlamaDecoderLayer) -> DecodeLayerWeights | None:
    """The layer's C description when its plan runs the one-call layer and it qualifies, else None."""
    from llmplatform.models.llama import LlamaMLP  # llama imports this module

    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if layer.ops_layer is not RowImpl.C or attn.fused_rows <= 0:
        return None
    if type(mlp) is not LlamaMLP or mlp.c_rows <= 0 \
            or any(norm.unit_offset or norm.c_rows <= 0 for norm in norms) or norms[0].eps != norms[1].eps:
        return None
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(type(p) is not Linear or p._row_weight is None or p.small_rows <= 0 for p in projections):
        return None
    return describe_layer(LayerTensors(
        input_norm=norms[0].weight.detach(), post_norm=norms[1].weight.detach(),
        qkv=attn.qkv_proj._row_weight, o=attn.o_proj._row_weight,
        gate_up=mlp.gate_up_proj._row_weight, down=mlp.down_proj._row_weight,
        biases=tuple(p._row_bias for p in projections),  # type: ignore[arg-type]
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        eps=norms[0].eps, scale=attn.scale, sliding_window=attn.sliding_window, softcap=attn.softcap))


def describe_all(layers: nn.ModuleList) -> None:
    """Sets each layer's ``c_layer`` (``describe``); the model's last build step. The layers of
    one call share a step description (``describe_step``), so they must agree on heads, head
    size and dtype; a model whose layers do not (none here yet) keeps the per-op path."""
    described = [describe(layer) for layer in layers]
    shapes = {(d.num_heads, d.num_kv_heads, d.head_dim, d.is_bf16) for d in described if d is not None}
    for layer, description in zip(layers, described):
        layer.c_layer = description if len(shapes) == 1 else None
