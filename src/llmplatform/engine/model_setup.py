"""Loading a model the way the engine runs it, the same on every tensor-parallel rank.

``prepare_model`` chooses the kernels (``decode_path.model_ops``: the decode path, the attention
backend, the compute dtype, oneDNN's prepacked weights) and builds the model with them, loading
the weights (one rank's shard of them under tensor parallelism); ``copy_kv_blocks`` applies the
scheduler's copy-on-write block copies to a KV pool. The model runner (rank 0) and the other ranks
(``engine.parallel.rank_process``) both call them, so every rank's shard runs the same code path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmplatform.engine.config import ModelConfig
from llmplatform.engine.decode_path import model_ops
from llmplatform.kernels.ops import ModelOps
from llmplatform.models.layers import Linear
from llmplatform.models.loader import load_model
from llmplatform.models.parallel import ShardGroup
from llmplatform.models.pipeline import PipelineStage
from llmplatform.models.rope import is_partial_rotary
from llmplatform.utils.torch_utils import resolve_compute_dtype

logger = logging.getLogger("llmplatform.engine")


@dataclass(frozen=True)
class PreparedModel:
    model: torch.nn.Module
    ops: ModelOps  # the kernels it runs, chosen before it was built

    @property
    def decode_path(self) -> str:  # the path taken: eager or fused
        return self.ops.decode_path

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.ops.compute_dtype

    @property
    def onednn_linears(self) -> int:
        """Projections on oneDNN's prepacked weights."""
        return sum(1 for m in self.model.modules() if isinstance(m, Linear) and m._onednn_weight is not None)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prepare_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, shard: ShardGroup | None = None,
                  stage: PipelineStage | None = None) -> PreparedModel:
    """``shard``: this tensor-parallel rank's shard; ``stage``: this pipeline stage's layers."""
    compute_dtype = resolve_compute_dtype(model_config.compute_dtype, dtype, device)
    if compute_dtype != dtype:
        logger.info("matrix products in %s over %s weights (%s)", _name(compute_dtype),
                    _name(dtype), "--compute-dtype float32" if model_config.compute_dtype
                    == "float32" else "this CPU has no bf16/fp16 matrix instructions; "
                    "--compute-dtype model keeps them in the model dtype")
    from transformers import AutoConfig

    partial_rotary = is_partial_rotary(AutoConfig.from_pretrained(model_config.model_path))
    ops = model_ops(model_config, device, dtype, compute_dtype, partial_rotary=partial_rotary)
    model = load_model(model_config.model_path, dtype=dtype, device=device, max_model_len=max_model_len,
                       shard=shard, quantized_gguf=model_config.quantized_gguf, ops=ops, stage=stage)
    prepared = PreparedModel(model, ops)
    if prepared.onednn_linears:
        logger.info("%s projections run on oneDNN with prepacked weights (%d)", _name(compute_dtype),
                    prepared.onednn_linears)
    return prepared


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
