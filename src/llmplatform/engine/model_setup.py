"""Loading a model the way the engine runs it, the same on every tensor-parallel rank.

``prepare_model`` loads the weights (one rank's shard of them under tensor parallelism), sets up
the decode path, the compute dtype and the CPU's prepacked weights; ``copy_kv_blocks`` applies the
scheduler's copy-on-write block copies to a KV pool. The model runner (rank 0) and the other ranks
(``engine.parallel.rank_process``) both call them, so every rank's shard runs the same code path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmplatform.engine.config import ModelConfig
from llmplatform.engine.decode_path import apply_decode_path
from llmplatform.models.layers import use_onednn_weights
from llmplatform.models.loader import load_model
from llmplatform.models.parallel import ShardGroup
from llmplatform.utils.torch_utils import resolve_compute_dtype

logger = logging.getLogger("llmplatform.engine")


@dataclass(frozen=True)
class PreparedModel:
    model: torch.nn.Module
    decode_path: str  # the path taken: eager or fused
    compute_dtype: torch.dtype
    onednn_linears: int  # projections switched to oneDNN's prepacked weights


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prepare_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, shard: ShardGroup | None = None) -> PreparedModel:
    model = load_model(model_config.model_path, dtype=dtype, device=device,
                       max_model_len=max_model_len, shard=shard, quantized_gguf=model_config.quantized_gguf)
    decode_path = apply_decode_path(model_config.decode_path, model, device)
    compute_dtype = resolve_compute_dtype(model_config.compute_dtype, dtype, device)
    if compute_dtype != dtype:
        logger.info("matrix products in %s over %s weights (%s)", _name(compute_dtype),
                    _name(dtype), "--compute-dtype float32" if model_config.compute_dtype
                    == "float32" else "this CPU has no bf16/fp16 matrix instructions; "
                    "--compute-dtype model keeps them in the model dtype")
        model.use_compute_dtype(compute_dtype)
    onednn_linears = use_onednn_weights(model) if device.type == "cpu" else 0
    return PreparedModel(model, decode_path, compute_dtype, onednn_linears)


def copy_kv_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   blocks_to_copy: list[tuple[int, int]], device: torch.device) -> None:
    """Copies each (source, destination) block of every layer's K and V."""
    if not blocks_to_copy:
        return
    src = torch.tensor([s for s, _ in blocks_to_copy], device=device)
    dst = torch.tensor([d for _, d in blocks_to_copy], device=device)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
