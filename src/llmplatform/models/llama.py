"""The Llama family (Llama 1-3, Mistral, Qwen2) over a paged KV cache, and the blocks Qwen3 composes
(its attention block: ``models.attention``).

Tokens of all sequences in a step are flattened into one batch without padding; attention
metadata (``kernels.AttentionMetadata``) says which tokens belong to which sequence, where their
K/V go in the cache and what each may attend to. One layer:

    h ─┬─ RMSNorm ─ qkv_proj ─ rotary(q, k) ─ store k, v ─ paged_attention ─ o_proj ─(+)─> h'
       └───────────────────────────── residual ────────────────────────────────────┘
    h'─┬─ RMSNorm ─ gate_up_proj ─ silu(gate) * up ─ down_proj ─(+)─> next layer
       └────────────────────── residual ─────────────────────────┘

The residual add happens inside the next RMSNorm call. q/k/v and gate/up are fused projections
(one matmul each instead of three and two); the loader stacks the checkpoint's matrices into them.

Given a ``ShardGroup`` of N > 1 ranks (tensor parallelism, ``models.parallel``), each module holds
one rank's shard: H/N query heads, Hkv/N key/value heads (and their KV cache), I/N MLP columns,
V/N vocabulary rows; ``o_proj``, ``down_proj`` and the embedding all-reduce, and
``compute_logits`` gathers the logits on rank 0. Counts below (``num_heads``, ``num_kv_heads``)
are this rank's.

Every block takes the model's ``ModelOps`` (``kernels.ops``), resolved once before the model is
built, and runs the kernels it names; a new family composes these blocks (or its own, taking the
same plan) and gives its model class ``process_weights_after_loading``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmplatform.kernels import AttentionMetadata
from llmplatform.kernels.cpu_activation import silu_mul_cpu
from llmplatform.kernels.cpu_decode_layer import DecodeLayerWeights, decode_layer_cpu, describe_step
from llmplatform.kernels.ops import ModelOps, RowImpl
from llmplatform.models.layers import (
    ALL_ROWS,
    Linear,
    RMSNorm,
    kernel_rows,
    process_weights_after_loading,
    reference_ops,
)
from llmplatform.models.attention import KVCache, LlamaAttention, head_dim_of, num_kv_heads_of
from llmplatform.models.decode_layer import describe_all as describe_decoder_layers
from llmplatform.models.parallel import (
    ShardGroup,
    check_divisible,
    column_linear,
    gather_logits,
    lm_head_linear,
    row_linear,
    vocab_embedding,
)
from llmplatform.models.pipeline import PipelineStage
from llmplatform.models.weight_arena import pack_row_weights
from llmplatform.models.rope import RotaryEmbedding, rope_max_position, rope_parameters


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding attention window (None: full attention), as transformers computes
    them: a config's ``layer_types`` ("sliding_attention" layers windowed) when it has them; else
    Qwen2/Qwen3's ``use_sliding_window`` windows the layers from ``max_window_layers`` on; else
    (Mistral) ``sliding_window`` applies to every layer."""
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    if not isinstance(window, int) or window <= 0:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if getattr(config, "model_type", None) in ("qwen2", "qwen3"):
        if not getattr(config, "use_sliding_window", False):
            return [None] * num_layers
        first = getattr(config, "max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers


MLP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gates ``LlamaMLP`` computes: SwiGLU, GeGLU with tanh-approximated GELU (Gemma)."""


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``activation``: one of ``MLP_ACTIVATIONS`` (default: the
    config's ``hidden_act``)."""

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str,
                 shard: ShardGroup | None = None, ops: ModelOps | None = None,
                 activation: str | None = None) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        activation = activation or getattr(config, "hidden_act", "silu")
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} (only {', '.join(MLP_ACTIVATIONS)})")
        self.activation = activation
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.intermediate_size = size // (1 if shard is None else shard.size)  # this rank's columns
        self.gate_up_proj = column_linear(shard, config.hidden_size, [size, size], bias=bias,
                                          dtype=dtype, device=device, ops=ops)
        self.down_proj = row_linear(shard, size, config.hidden_size, bias=bias, dtype=dtype, device=device,
                                    ops=ops)
        # silu * up in one C call where the plan says so, every call (the kernel knows no GELU)
        self.c_rows = ALL_ROWS if ops.activation is RowImpl.C and activation == "silu" else -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if x.shape[0] <= self.c_rows:
            return self.down_proj(silu_mul_cpu(gate_up))  # [T, hidden]
        gate = gate_up[:, : self.intermediate_size]  # [T, intermediate]
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        act.mul_(gate_up[:, self.intermediate_size :])  # [T, intermediate] act(gate) * up
        return self.down_proj(act)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """``mlp``: the feed-forward block, when not the dense SwiGLU one (``models.moe``)."""

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str,
                 shard: ShardGroup | None = None, ops: ModelOps | None = None, qk_norm: bool = False,
                 sliding_window: int | None = None, mlp: nn.Module | None = None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device, ops=ops)
        self.self_attn = LlamaAttention(config, dtype=dtype, device=device, shard=shard, ops=ops, qk_norm=qk_norm,
                                        sliding_window=sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device, ops=ops)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, dtype=dtype, device=device, shard=shard, ops=ops)
        self.ops_layer = (ops or reference_ops(dtype, device)).layer  # whether the one-call layer may run
        self.c_layer: DecodeLayerWeights | None = None  # set after loading (models.decode_layer)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] the previous layer's output (before its residual add)
        residual: torch.Tensor | None,  # [T, hidden] the residual stream; None at layer 0
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (mlp output [T, hidden], residual [T, hidden])
        x, residual = self.input_layernorm(x, residual)  # [T, hidden] each
        x = self.self_attn(x, cos, sin, rotary, kv_cache, attn_metadata)  # [T, hidden]
        x, residual = self.post_attention_layernorm(x, residual)  # [T, hidden] each
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, *, dtype: torch.dtype, device: torch.device | str, max_position: int,
        shard: ShardGroup | None = None, ops: ModelOps | None = None, qk_norm: bool = False,
        make_mlp: Callable[[int], nn.Module | None] | None = None,  # layer index -> its MLP (None: dense)
        stage: PipelineStage | None = None,  # a pipeline stage's layers only (models.pipeline)
    ) -> None:
        super().__init__()
        self.stage = stage
        self.embed_tokens: nn.Module | None = vocab_embedding(
            shard, config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        first, end = (0, config.num_hidden_layers) if stage is None else (stage.start_layer, stage.end_layer)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype=dtype, device=device, shard=shard, ops=ops, qk_norm=qk_norm,
                              sliding_window=window, mlp=None if make_mlp is None else make_mlp(index))
            for index, window in enumerate(layer_windows(config)) if first <= index < end
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device, ops=ops)
        self.c_layer_rows = kernel_rows(ops.small_rows if ops is not None and ops.layer is RowImpl.C else 0)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), rope_parameters(config), max_position=max_position,
            trained_max_position=config.max_position_embeddings, device=device,
        )
        if ops is not None and ops.rotary is RowImpl.C and self.rotary_emb.is_partial:
            raise ValueError("the ops plan runs the whole-head C rotary kernel on a partial-rotary model "
                             "(resolve_ops(partial_rotary=True) keeps its rotary on torch)")

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer (of this stage)
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # the previous stage's (x, residual)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, hidden]; a stage not last: (x, residual)
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            x, residual = intermediate  # [T, hidden] each
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)  # [T, 1, head_dim] each, shared by all layers
        # A step of a few rows: qualifying layers in one C call each (models.decode_layer).
        c_step = None
        if x.shape[0] <= self.c_layer_rows and kv_caches:
            first = next((layer.c_layer for layer in self.layers if layer.c_layer is not None), None)
            if first is not None:
                c_step = describe_step(attn_metadata, cos, sin, kv_caches[0][0], kv_caches[0][1], first)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if c_step is not None and layer.c_layer is not None:
                x, residual = decode_layer_cpu(layer.c_layer, c_step, *kv_cache, x, residual)
            else:
                x, residual = layer(x, residual, cos, sin, self.rotary_emb, kv_cache, attn_metadata)
        if self.stage is not None and not self.stage.is_last:
            return x, residual
        x, _ = self.norm(x, residual)  # [T, hidden]
        return x


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache.

    Parameters are created empty; ``models.loader.load_weights`` fills them from a checkpoint
    (or use ``models.loader.load_model``), then ``process_weights_after_loading`` makes the
    weight forms the plan multiplies with. ``max_model_len`` bounds the rotary table (default:
    what the config supports). ``shard``: build this rank's shard of a tensor-parallel model
    (``models.parallel``; None or one rank: the whole model). ``ops``: the kernels to run
    (``kernels.ops.resolve_ops``; None: the torch reference).

    A family that differs only in block options subclasses this and sets them (``models.qwen3``).
    """

    decoder_class: type[nn.Module] = LlamaModel
    """The network under the LM head, built with ``LlamaModel``'s arguments (``models.gemma``)."""
    hidden_act_field = "hidden_act"
    """The config field naming the MLP's activation (Gemma's is ``hidden_activation``)."""
    qk_norm = False
    """Per-head RMSNorm of q and k before rotary (``LlamaAttention``)."""
    partial_rotary = False
    """Whether the family honours a config's ``partial_rotary_factor`` (``models.rope``) as its
    reference implementation does; transformers' Llama rotates whole heads whatever it says, so
    the registry refuses such a config rather than compute something no reference computes."""

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        shard: ShardGroup | None = None,
        ops: ModelOps | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        self.ops = ops
        if shard is not None and shard.size == 1:
            shard = None
        if shard is not None:
            check_divisible(config, shard.size)
        self.config = config
        self.dtype = dtype
        self.shard = shard
        self.vocab_size = config.vocab_size  # the logits' width (every rank's slice gathered)
        # ``stage``: one pipeline stage's layers (and KV cache) only (models.pipeline).
        self.stage = stage if stage is not None and stage.size > 1 else None
        self.num_layers = config.num_hidden_layers if self.stage is None else self.stage.num_layers
        self.num_kv_heads = num_kv_heads_of(config) // (1 if shard is None else shard.size)  # this rank's
        self.head_dim = head_dim_of(config)
        max_position = rope_max_position(config)
        if max_model_len is not None:
            max_position = min(max_position, max_model_len)
        self.max_position = max_position
        self.model = self.decoder_class(
            config, dtype=dtype, device=device, max_position=max_position, shard=shard, ops=ops,
            qk_norm=self.qk_norm,
            make_mlp=lambda index: self.make_mlp(index, dtype=dtype, device=device, shard=shard, ops=ops),
            **({} if self.stage is None else {"stage": self.stage}))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.has_head = self.stage is None or self.stage.is_last
        if self.stage is not None and not (self.stage.is_first or (self.has_head and self.tie_word_embeddings)):
            self.model.embed_tokens = None  # neither its input nor (tied) its head
        self.lm_head = (
            None if self.tie_word_embeddings or not self.has_head
            else lm_head_linear(shard, config.hidden_size, config.vocab_size, dtype=dtype, device=device, ops=ops)
        )
        # --quantization gguf (models.quantized): the output projection kept in GGUF blocks, for
        # the rows its kernel takes (``ops.quantized_rows``); more rows use the dense one.
        self.quantized_lm_head: Linear | None = None

    def make_mlp(self, layer_index: int, *, dtype: torch.dtype, device: torch.device | str,
                 shard: ShardGroup | None, ops: ModelOps) -> nn.Module | None:
        """Layer ``layer_index``'s feed-forward block; None: the decoder's dense MLP (``LlamaMLP``). A
        family with experts returns its routed block here (``models.mixtral``, ``models.qwen3_moe``)."""
        return None

    @property
    def attention_window(self) -> int | None:
        """How far back any layer attends: None when some layer sees the whole context (keep all
        KV), else the largest window of its layers (the engine frees KV older than that)."""
        windows = (layer_windows(self.config) if self.stage is not None  # every stage's layers
                   else [layer.self_attn.sliding_window for layer in self.model.layers])
        return None if None in windows else max(windows)

    def process_weights_after_loading(self) -> None:
        """Once, after the weights (and any quantized projections) are in: each projection makes
        the weight forms its plan multiplies with (``Linear.process_weights_after_loading``), and
        with tied embeddings the output projection becomes a ``Linear`` over the embedding matrix
        (its own copy only where the plan needs another dtype or layout)."""
        process_weights_after_loading(self)
        tied: list[Linear] = []
        if self.lm_head is None and self.has_head:
            # prepacked for oneDNN like any projection: a copy (the embedding keeps its weight),
            # worth it on a vocabulary-sized product (49,152 x 576, 32 rows: 8.8 -> 7.0 ms)
            head = Linear(self.config.hidden_size, [self.lm_head_weight.shape[0]], bias=False,
                          dtype=self.dtype, device="meta", ops=self.ops)
            head.weight = self.model.embed_tokens.weight
            head.process_weights_after_loading()
            # Not a submodule: the model's parameters, state dict and projection count stay the
            # checkpoint's (the weight is the embedding's).
            self.__dict__["_tied_lm_head"] = head
            tied.append(head)
        pack_row_weights(self, tied, self.model.embed_tokens if tied else None)  # before the C layers' pointers
        if isinstance(self.model, LlamaModel):
            describe_decoder_layers(self.model.layers)

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden] (sharded: this rank's rows)
        """The output projection: the embedding matrix itself when the config ties them."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the new tokens of all sequences, flattened
        positions: torch.Tensor,  # [T] int64, each token's position in its sequence
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer (of this stage)
        attn_metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # a later stage's input
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, hidden]; a stage not last: (x, residual)
        if intermediate is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """Logits (model dtype) of the rows the caller samples from. Sharded: a collective that
        every rank calls with the same rows; rank 0 gets the whole vocabulary's logits."""
        if self.shard is not None:
            return gather_logits(self.shard, self._local_logits(hidden), self.vocab_size)
        return self._local_logits(hidden)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab rows]
        quantized = self.quantized_lm_head
        if quantized is not None and hidden.shape[0] <= quantized.small_rows:
            return quantized(hidden)
        head = self.lm_head if self.lm_head is not None else self._tied_lm_head
        return head(hidden)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of each layer's k_cache and v_cache."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, *, device: torch.device | str | None = None
    ) -> list[KVCache]:
        """Zeroed caches for every layer (zeros, not empty: padding slots are read and masked,
        and a NaN bit pattern would survive the mask)."""
        device = device if device is not None else next(self.parameters()).device
        shape = self.kv_cache_shape(num_blocks, block_size)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))
            for _ in range(self.num_layers)
        ]

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block costs across all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element
