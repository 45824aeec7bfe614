"""A whole decoder layer of a decode step in one C call (``csrc/decode_layer.c``): the fused
decode path's layer when its plan says so (``ModelOps.layer``).

The fused path already runs every op of a decode step's layer on a C kernel; called one by one
from Python, a layer is eight kernel calls, each with its checks, output allocations and ctypes
conversion, which at one row cost about as much as the kernels themselves. Here the layer's
weights are described once (``DecodeLayerWeights``, built after loading), the step's cache
addressing once per step (``DecodeLayerStep``), and each layer is one call that runs the same
kernels in the same order: on a decode step the output is bit for bit the per-op path's. Steps of
up to ``small_rows`` rows where a sequence has several (verification, short prefill chunks) run
here too, one query per row (``describe_step``), where the per-op path runs torch's causal
attention: the same result to float rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from llmplatform.kernels import cbuild, cpu_decode
from llmplatform.kernels.metadata import AttentionMetadata

_p, _f, _i64, _int = ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_int


class DecodeLayerWeights(ctypes.Structure):
    """``struct decode_layer_weights``: pointers into the layer's tensors (which must outlive it)."""
    _fields_ = [
        ("input_norm", _p), ("post_norm", _p),
        ("qkv", _p), ("o", _p), ("gate_up", _p), ("down", _p),
        ("qkv_bias", _p), ("o_bias", _p), ("gate_up_bias", _p), ("down_bias", _p),
        ("qkv_bf16", _int), ("o_bf16", _int), ("gate_up_bf16", _int), ("down_bf16", _int),
        ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f), ("scale", _f), ("softcap", _f),
        ("window", _i64),
        ("is_bf16", _int),
    ]


class DecodeLayerStep(ctypes.Structure):
    """``struct decode_layer_step``: one step's rows and cache addressing, shared by every layer."""
    _fields_ = [
        ("rows", _i64), ("cos", _p), ("sin", _p), ("slots", _p), ("block_tables", _p),
        ("table_stride", _i64), ("seq_lens", _p), ("block_size", _i64), ("num_threads", _int),
    ]


kernel = cbuild.LazyFunction(
    "decode_layer.c", "decode_layer",
    [ctypes.POINTER(DecodeLayerWeights), ctypes.POINTER(DecodeLayerStep), _p, _p, _p, _p, _p, _p], _int,
    "CPU decode-layer kernel")
available = kernel.available


@dataclass(frozen=True)
class LayerTensors:
    """What one layer's call reads: the weights as the row kernels take them (``Linear``'s
    ``_row_weight``/``_row_bias``), in the model dtype where noted."""
    input_norm: torch.Tensor  # [hidden] model dtype
    post_norm: torch.Tensor  # [hidden] model dtype
    qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden]
    o: torch.Tensor  # [hidden, H D]
    gate_up: torch.Tensor  # [2 I, hidden], gate rows first
    down: torch.Tensor  # [hidden, I]
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]  # fp32
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    sliding_window: int | None
    softcap: float | None


def describe_layer(t: LayerTensors) -> DecodeLayerWeights:
    """The C description of a layer; raises ValueError for what the kernel does not take."""
    dtype = t.input_norm.dtype
    if dtype not in (torch.bfloat16, torch.float32) or t.post_norm.dtype != dtype:
        raise ValueError(f"decode layer: model dtype {dtype} unsupported")
    products = (t.qkv, t.o, t.gate_up, t.down)
    if any(w.dtype not in (torch.bfloat16, torch.float32) or not w.is_contiguous() or w.device.type != "cpu"
           for w in products):
        raise ValueError("decode layer: weights must be contiguous bf16 or fp32 CPU tensors")
    hidden, q_width = t.qkv.shape[1], t.num_heads * t.head_dim
    intermediate = t.down.shape[1]
    if (t.qkv.shape[0] != q_width + 2 * t.num_kv_heads * t.head_dim or t.o.shape != (hidden, q_width)
            or t.gate_up.shape != (2 * intermediate, hidden) or t.down.shape[0] != hidden
            or t.input_norm.shape != (hidden,) or t.post_norm.shape != (hidden,)):
        raise ValueError("decode layer: weight shapes do not form one layer")
    for bias, weight in zip(t.biases, products):
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)
                                 or not bias.is_contiguous()):
            raise ValueError("decode layer: biases must be contiguous fp32")
    ptr = lambda tensor: None if tensor is None else tensor.data_ptr()  # noqa: E731
    return DecodeLayerWeights(
        ptr(t.input_norm), ptr(t.post_norm), ptr(t.qkv), ptr(t.o), ptr(t.gate_up), ptr(t.down),
        *(ptr(bias) for bias in t.biases),
        *(int(w.dtype == torch.bfloat16) for w in products),
        hidden, t.num_heads, t.num_kv_heads, t.head_dim, intermediate,
        t.eps, t.scale, t.softcap or 0.0, t.sliding_window or 0, int(dtype == torch.bfloat16))


def describe_step(metadata: AttentionMetadata, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, weights: DecodeLayerWeights) -> DecodeLayerStep | None:
    """The step's description for layers of ``weights``' shape (every layer of a model shares
    it, and its caches one layout), or None when the kernels do not take it (a cache layout,
    dtype or shape the rotary and attention kernels refuse: the per-op path then runs).

    A sequence with several new rows (a speculative verification, a short prefill chunk) is
    computed as that many one-token queries: the layer stores every row's K/V before attention
    runs, so row j of a sequence attending over the cache up to its own position (its own
    length, its sequence's block table) is exactly causal attention within the step."""
    dtype = torch.bfloat16 if weights.is_bf16 else torch.float32
    rows = metadata.num_tokens
    if cos.dtype != dtype or sin.dtype != dtype or k_cache.dtype != dtype:
        return None
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.numel() == rows * weights.head_dim
            and k_cache.is_contiguous() and k_cache.device.type == "cpu"
            and v_cache.shape == k_cache.shape and v_cache.dtype == dtype and v_cache.is_contiguous()
            and cpu_decode.supports_heads(weights.num_heads, k_cache)):
        return None
    slots, tables, lens = metadata.slot_mapping, metadata.block_tables, metadata.seq_lens
    if slots.dtype != torch.int64 or tables.dtype != torch.int32 or lens.dtype != torch.int32 \
            or not (slots.is_contiguous() and tables.is_contiguous() and lens.is_contiguous()):
        return None
    keep: tuple[torch.Tensor, ...] = ()
    if not metadata.is_decode_only:  # one (length, block table) per row
        row_seq, row_lens = [], []
        for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
            row_seq += [i] * query_len
            row_lens += range(seq_len - query_len + 1, seq_len + 1)
        tables = tables.index_select(0, torch.tensor(row_seq, dtype=torch.long))  # [rows, max_blocks]
        lens = torch.tensor(row_lens, dtype=torch.int32)  # [rows]
        keep = (tables, lens)
    step = DecodeLayerStep(rows, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                           tables.shape[1], lens.data_ptr(), k_cache.shape[1], torch.get_num_threads())
    step.keep = keep  # the per-row tensors live as long as the description that points at them
    return step


def decode_layer_cpu(
    weights: DecodeLayerWeights,
    step: DecodeLayerStep,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (the step's checks passed for it)
    v_cache: torch.Tensor,  # same
    x: torch.Tensor,  # [rows, hidden] model dtype, contiguous: the previous layer's output
    residual: torch.Tensor | None,  # [rows, hidden] the residual stream; None at layer 0
) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual after it)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    rc = kernel()(ctypes.byref(weights), ctypes.byref(step), k_cache.data_ptr(), v_cache.data_ptr(),
                  x.data_ptr(), None if residual is None else residual.data_ptr(), out.data_ptr(),
                  residual_out.data_ptr())
    if rc == -1:
        raise MemoryError("decode_layer_cpu: out of memory for the layer's scratch buffers")
    if rc != 0:
        raise ValueError("decode_layer_cpu: the attention kernel refused the shape")
    return out, residual_out
