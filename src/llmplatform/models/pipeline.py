"""Pipeline stages: which contiguous range of decoder layers one stage of a model holds.

A model split into P stages (``--pipeline-parallel-size``) gives stage s the layers
``[s * L / P, (s + 1) * L / P)``; the first stage also holds the embedding, the last the final
norm and the LM head (with tied embeddings: the embedding matrix, as its head). A stage that is
not the first takes the previous stage's ``(hidden, residual)`` instead of token ids, and one that
is not the last returns them instead of the normed hidden states:

    stage 0: ids ─ embed ─ layers [0, L/P) ─> (x, residual) ─ send ─┐
    stage 1:          ┌──────────────── recv ──────────────────────┘
                      └─ layers [L/P, 2L/P) ─ ... ─ norm ─ lm_head ─> logits

Each stage's checkpoint names are mapped onto its own modules (``stage_weight_name``): layer i
of the checkpoint is the stage's layer ``i - start``, and what the stage does not hold is skipped,
so a stage reads and keeps only its own weights (and the KV cache of its own layers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` of ``size``: decoder layers ``[start_layer, end_layer)``."""

    index: int
    size: int
    start_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer


def stage_of(num_layers: int, size: int, index: int) -> PipelineStage:
    """Stage ``index``'s even share of ``num_layers`` (which ``check_pipeline_divisible`` has
    checked divides by ``size``)."""
    assert num_layers % size == 0 and 0 <= index < size
    per_stage = num_layers // size
    return PipelineStage(index, size, index * per_stage, (index + 1) * per_stage)


def check_pipeline_divisible(config: Any, size: int) -> None:
    """Raises ValueError, naming the sizes that fit, when this model's layers cannot be split
    evenly into ``size`` stages or its family cannot be split at all (checked before any rank
    is started)."""
    if size < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    from llmplatform.models.llama import LlamaModel
    from llmplatform.models.registry import get_model_class

    model_class = get_model_class(config)
    if getattr(model_class, "decoder_class", None) is not LlamaModel:
        raise ValueError(f"--pipeline-parallel-size does not split {model_class.__name__} yet "
                         f"(the Llama-block families do: Llama, Mistral, Qwen2/3, Qwen3-MoE, "
                         f"Mixtral, Phi-3); use --pipeline-parallel-size 1")
    num_layers = config.num_hidden_layers
    if num_layers % size:
        fitting = [n for n in range(1, num_layers + 1) if num_layers % n == 0]
        raise ValueError(
            f"--pipeline-parallel-size {size} does not divide this model's {num_layers} decoder "
            f"layers: each stage holds an equal, contiguous range of layers (sizes that fit: "
            f"{', '.join(map(str, fitting))})")


def stage_weight_name(checkpoint_name: str, stage: PipelineStage, *, keeps_embedding: bool
                      ) -> str | None:
    """The name of ``checkpoint_name``'s parameter in ``stage``'s model, or None when the stage
    does not hold it."""
    match = _LAYER.match(checkpoint_name)
    if match is not None:
        layer = int(match.group(1))
        if not stage.start_layer <= layer < stage.end_layer:
            return None
        return f"model.layers.{layer - stage.start_layer}.{match.group(2)}"
    if checkpoint_name == "model.embed_tokens.weight":
        return checkpoint_name if keeps_embedding else None
    if checkpoint_name == "lm_head.weight":
        return checkpoint_name if stage.is_last else None
    return checkpoint_name
