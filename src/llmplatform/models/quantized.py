"""Weight-only quantized projections: a GGUF model's Q8_0 / Q4_1 blocks kept as they are
(``--quantization gguf``), instead of the dequantized copy the model directory holds.

A GGUF model is served from the float32 directory ``llm.resolve`` converts it into (config,
tokenizer, every weight). With the switch on, ``keep_gguf_quantized`` then replaces each projection
(q/k/v, o, gate/up, down; per layer) whose GGUF tensors are in a supported block format (for the
architectures in ``QUANTIZED_ARCHITECTURES``) by a ``QuantizedLinear`` over the file's raw blocks,
read with ``gguf.GGUFReader``, and gives the model a quantized twin of its output projection
(``output.weight``, or with tied embeddings ``token_embd.weight``: the default model's is Q8_0) for
the rows of decode steps; norms, the embedding lookup and the dense output projection (for larger
row counts, e.g. prompt logprobs) stay as loaded. A projection whose tensors are in another format
(a k-quant, say) stays dense, with a warning saying how many did.

``QuantizedLinear`` runs products of up to the plan's ``quantized_rows`` (``kernels.ops``: the
fused decode path's row count) on the C kernel (``kernels.cpu_quant_linear``: each block read
once, fp32 sums) and larger ones (prefill chunks) by dequantizing the weight to the compute dtype
for the call and multiplying with ``F.linear``. Without the fused path (``--decode-path eager``,
or no C compiler) every product takes the second way: right, but a decode step then dequantizes
every weight.

Layout facts the loading relies on: a GGUF tensor of shape ``[n, k]`` (ggml lists it as
``(k, n)``) is ``n`` rows of ``k / 32`` blocks; llama.cpp's converter stores a Llama's q and k
projections with the rows of each head reordered (the two rotary halves interleaved), which the
loader undoes on whole rows of blocks, as transformers does on the dequantized weights; Phi-3's
q/k/v (``attn_qkv``) and gate/up (``ffn_up``, gate rows first) are one tensor each, whose rows
fill our fused projection as they are. A MoE model's experts are stacked 3-D tensors
(``ffn_*_exps``): they stay dequantized, only its attention projections keep their blocks.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmplatform.kernels import cpu_quant_linear
from llmplatform.kernels.cpu_quant_linear import (FORMATS, dequantize_cpu, dequantize_reference,
                                                  quant_linear_cpu)
from llmplatform.kernels.ops import ModelOps, RowImpl
from llmplatform.models.gguf_export import unpermute_rows
from llmplatform.models.layers import Linear, kernel_rows

logger = logging.getLogger("llmplatform.models")

# GGUF tensor kind (blk.N.<kind>.weight) -> (our module under model.layers.N, the shards its rows
# fill, in order). llama.cpp writes most families' projections one per tensor; Phi-3's q/k/v as one
# attn_qkv and its gate and up as one ffn_up (gate rows first), as its HF checkpoint holds them.
_SEPARATE = {
    "attn_q": ("self_attn.qkv_proj", (0,)),
    "attn_k": ("self_attn.qkv_proj", (1,)),
    "attn_v": ("self_attn.qkv_proj", (2,)),
    "attn_output": ("self_attn.o_proj", (0,)),
    "ffn_gate": ("mlp.gate_up_proj", (0,)),
    "ffn_up": ("mlp.gate_up_proj", (1,)),
    "ffn_down": ("mlp.down_proj", (0,)),
}
_FUSED = {
    "attn_qkv": ("self_attn.qkv_proj", (0, 1, 2)),
    "attn_output": ("self_attn.o_proj", (0,)),
    "ffn_up": ("mlp.gate_up_proj", (0, 1)),
    "ffn_down": ("mlp.down_proj", (0,)),
}


@dataclass(frozen=True)
class _Layout:
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    permuted_qk: bool = False
    """q / k rows in llama.cpp's per-head rotary order (its Llama converter; Mixtral is arch llama)."""


_LAYOUTS = {
    "llama": _Layout(_SEPARATE, permuted_qk=True),
    "qwen2": _Layout(_SEPARATE),
    "qwen3": _Layout(_SEPARATE),
    "qwen3moe": _Layout(_SEPARATE),
    "phi3": _Layout(_FUSED),
    "gemma2": _Layout(_SEPARATE),
    "gemma3": _Layout(_SEPARATE),
}
QUANTIZED_ARCHITECTURES = tuple(_LAYOUTS)
"""GGUF architectures whose projections can stay quantized (their tensor names and row orders
are known here). A MoE model's experts (stacked ``ffn_*_exps`` tensors) stay dequantized."""

_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_EXPERTS = re.compile(r"blk\.\d+\.ffn_\w+_exps\.weight")


class QuantizedLinear(Linear):
    """A ``Linear`` whose weight is GGUF blocks (``blocks``: uint8 ``[n, k / 32 * block_bytes]``
    in ``weight_format``); ``weight`` is None. The bias, if any, stays dense. Products of up to
    ``ops.quantized_rows`` rows run on the C kernel over the blocks, larger ones dequantize the
    weight (``ops.dequantize``) to ``ops.compute_dtype`` for the call."""

    def __init__(self, blocks: torch.Tensor, weight_format: str, output_sizes: list[int],
                 bias: nn.Parameter | None, ops: ModelOps) -> None:
        nn.Module.__init__(self)  # not Linear's: no dense weight is allocated
        self.output_sizes = list(output_sizes)
        self.weight = None
        self.bias = bias
        self.ops = ops
        self.small_rows = kernel_rows(ops.quantized_rows)
        self._onednn_weight = None
        self.weight_format = weight_format
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.in_features = cpu_quant_linear.in_features(blocks, weight_format)
        self.compute_dtype = ops.compute_dtype
        self._dequantize = dequantize_cpu if ops.dequantize is RowImpl.C else dequantize_reference
        self._bias32 = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def replacing(cls, dense: Linear, blocks: torch.Tensor, weight_format: str) -> QuantizedLinear:
        """The quantized twin of ``dense`` (its shards, bias and plan)."""
        return cls(blocks, weight_format, dense.output_sizes, dense.bias, dense.ops)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def process_weights_after_loading(self) -> None:
        """Nothing to make: the blocks are multiplied as read."""

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # [n, k]
        return self._dequantize(self.blocks, self.weight_format, dtype)

    def forward(self, x: torch.Tensor,  # [T, k]
                out_dtype: torch.dtype | None = None,  # default: x's
                ) -> torch.Tensor:  # [T, n]
        if x.shape[0] <= self.small_rows:
            return quant_linear_cpu(x, self.blocks, self.weight_format, self._bias32, out_dtype)
        dtype = self.compute_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        y = F.linear(x.to(dtype), self.dequantized(dtype), bias)  # [T, n]
        return y.to(out_dtype or x.dtype)


def keep_gguf_quantized(model: nn.Module, gguf_path: str | Path) -> int:
    """Replace ``model``'s projections by ``QuantizedLinear``s over ``gguf_path``'s blocks (the
    model was loaded from that file's converted directory); returns how many were replaced.

    Raises ``ValueError`` for an architecture whose layout is not known here, a model off the
    CPU, or a file that does not match the model (the first layer's projections are checked
    against their dense weights, which catches a wrong row order)."""
    from gguf import GGUFReader

    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"--quantization gguf runs on the CPU only, not {device}")
    reader = GGUFReader(str(gguf_path))
    arch = _architecture(reader)
    layout = _LAYOUTS.get(arch)
    if layout is None:
        raise ValueError(f"--quantization gguf: {gguf_path} is a {arch!r} model; its projections "
                         f"can stay quantized for {', '.join(QUANTIZED_ARCHITECTURES)} only")
    tensors_of: dict[str, list[Any]] = defaultdict(list)  # our module name -> its GGUF tensors
    for tensor in reader.tensors:
        match = _TENSOR_NAME.fullmatch(tensor.name)
        if match and match.group(2) in layout.tensors:
            module, _ = layout.tensors[match.group(2)]
            tensors_of[f"model.layers.{match.group(1)}.{module}"].append(tensor)
    config = model.config
    replaced, dense = 0, defaultdict(int)  # dense: format -> projections left dense
    for name, tensors in tensors_of.items():
        linear = model.get_submodule(name)
        tensors.sort(key=lambda t: _shards(layout, t)[0])
        kinds = {t.tensor_type.name.lower() for t in tensors}
        shards = [shard for t in tensors for shard in _shards(layout, t)]
        if shards != list(range(len(linear.output_sizes))) or len(kinds) != 1 or next(iter(kinds)) not in FORMATS:
            dense["+".join(sorted(kinds))] += 1
            continue
        fmt = next(iter(kinds))
        rows = []
        for tensor in tensors:
            blocks = np.asarray(tensor.data)  # [rows, k / 32 * block_bytes] uint8 (memory-mapped)
            covers = _shards(layout, tensor)
            if layout.permuted_qk and covers in ((0,), (1,)) and name.endswith("qkv_proj"):
                heads = config.num_attention_heads if covers == (0,) else \
                    getattr(config, "num_key_value_heads", None) or config.num_attention_heads
                blocks = unpermute_rows(blocks, heads)
            expected = sum(linear.output_sizes[shard] for shard in covers)
            if blocks.shape[0] != expected:
                raise ValueError(f"{gguf_path}: {tensor.name} has {blocks.shape[0]} rows, the model "
                                 f"expects {expected}")
            rows.append(blocks)
        quantized = QuantizedLinear.replacing(linear, torch.from_numpy(np.concatenate(rows)), fmt)
        if quantized.in_features != linear.weight.shape[1]:
            raise ValueError(f"{gguf_path}: {name} takes {quantized.in_features} inputs in the file, "
                             f"{linear.weight.shape[1]} in the model")
        if name.startswith("model.layers.0."):  # every projection of one layer: cheap, and it sees q/k's rows
            _check_against_dense(quantized, linear.weight, f"{gguf_path}: {name}")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, quantized)
        replaced += 1
    experts = sum(1 for tensor in reader.tensors if _EXPERTS.fullmatch(tensor.name))
    if experts:
        logger.info("--quantization gguf: %d MoE expert tensors stay dequantized (stacked experts have no "
                    "quantized kernel here); the attention projections keep their blocks", experts)
    head = _quantized_lm_head(model, reader, gguf_path)
    if head is not None:
        model.quantized_lm_head = head
    else:
        logger.info("--quantization gguf: the output projection stays dense (its GGUF tensor is in "
                    "none of %s)", ", ".join(FORMATS))
    if dense:
        logger.warning("--quantization gguf: %s stayed dense (formats without a kernel here)",
                       ", ".join(f"{count} {fmt} projections" for fmt, count in dense.items()))
    if not replaced:
        raise ValueError(f"--quantization gguf: no projection of {gguf_path} is in a supported "
                         f"block format ({', '.join(FORMATS)})")
    return replaced


def _quantized_lm_head(model: nn.Module, reader: Any, gguf_path: str | Path) -> QuantizedLinear | None:
    """The output projection's blocks (``output.weight``, or with tied embeddings the token
    embedding's), when they are in a supported format; checked against the dense head."""
    name = "token_embd.weight" if model.lm_head is None else "output.weight"
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None or tensor.tensor_type.name.lower() not in FORMATS:
        return None
    dense = model.lm_head_weight
    blocks = torch.from_numpy(np.array(tensor.data))  # [vocab, hidden / 32 * block_bytes] uint8
    head = QuantizedLinear(blocks, tensor.tensor_type.name.lower(), [dense.shape[0]], None, model.ops)
    if blocks.shape[0] != dense.shape[0] or head.in_features != dense.shape[1]:
        raise ValueError(f"{gguf_path}: {name} is {blocks.shape[0]} x {head.in_features}, the model's "
                         f"output projection {dense.shape[0]} x {dense.shape[1]}")
    _check_against_dense(head, dense, f"{gguf_path}: {name}")
    return head


def quantization_summary(model: nn.Module) -> str | None:
    """How the projections are held, for the worker's startup summary; None when all are dense."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not quantized:
        return None
    total = sum(1 for m in model.modules() if isinstance(m, Linear))
    formats = sorted({m.weight_format for m in quantized})
    nbytes = sum(m.weight_bytes for m in quantized)
    how = "decode steps on the C kernel" if all(m.small_rows > 0 for m in quantized) \
        else "every product dequantized: no fused decode path"
    return (f"projections kept quantized: {'+'.join(formats)} ({len(quantized)}/{total}, "
            f"{nbytes / 1e6:.1f} MB; {how})")


def _architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    return str(field.contents()) if field is not None else "unknown"


def _shards(layout: _Layout, tensor: Any) -> tuple[int, ...]:
    """The shards of its module that a projection tensor's rows fill."""
    return layout.tensors[_TENSOR_NAME.fullmatch(tensor.name).group(2)][1]


def _check_against_dense(quantized: QuantizedLinear, dense: torch.Tensor, what: str) -> None:
    """The dense weight was dequantized from the same blocks (then rounded to the model dtype):
    the two agree to that rounding, or the file does not match the model."""
    reference = dense.detach().float()
    got = dequantize_reference(quantized.blocks, quantized.weight_format)
    tolerance = 2.0**-7 * reference.abs().max().item() + 1e-6  # bf16's relative rounding, twice
    error = (got - reference).abs().max().item()
    if error > tolerance:
        raise ValueError(f"{what}: the GGUF blocks differ from the model's converted weights by "
                         f"{error:.3g} (allowed {tolerance:.3g}): not the file this model was "
                         "converted from, or rows in an order this loader does not know")
