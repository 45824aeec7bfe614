"""How a decoder model (Llama/Mistral/Qwen2 architecture) is served as an embedding model by the
native engine's pooling mode (:mod:`llmplatform.engine.pooling`).

The pooling and the normalization come from the worker's flags (``--pooling``,
``--embed-normalize``) or, on ``auto``, from the folder: a sentence-transformers folder (as
gte-Qwen2 and e5-mistral ship) says it in ``1_Pooling/config.json`` (``lasttoken`` or
``mean_tokens``) and ``modules.json`` (a ``Normalize`` module); a bare decoder folder gets what
those models use, the last token's state, L2-normalized. ``sentence_bert_config.json``'s
``max_seq_length`` caps the inputs, and ``config.json``'s Matryoshka keys allow ``dimensions``
(:mod:`.encoder_config`). The model's tokenizer makes the token ids, its special tokens included
(the EOS that e5-mistral and gte-Qwen2 append for last-token pooling comes from their tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmplatform.engine.pooling import PoolingMode, PoolingParams
from llmplatform.llm.encoder_config import EmbeddingConfigError, read_pipeline

PoolingChoice = Literal["auto", "last", "mean"]
NormalizeChoice = Literal["auto", "yes", "no"]
POOLING_CHOICES: tuple[str, ...] = ("auto", "last", "mean")
NORMALIZE_CHOICES: tuple[str, ...] = ("auto", "yes", "no")

# sentence-transformers' pooling modes the engine's pooler computes.
_FROM_SENTENCE_TRANSFORMERS = {"lasttoken": PoolingMode.LAST, "mean_tokens": PoolingMode.MEAN}


@dataclass(frozen=True)
class DecoderEmbedding:
    """A decoder model's embedding pipeline, as the paged backend runs it."""

    pooling: PoolingParams
    max_seq_length: int | None
    """The folder's cap on input tokens (None: only the context length)."""
    do_lower_case: bool
    matryoshka_dimensions: tuple[int, ...] | None
    """As :class:`~llmplatform.llm.embedding.EmbeddingFacts` says."""


def decoder_embedding(model_path: str | Path, pooling: str = "auto",
                      normalize: str = "auto") -> DecoderEmbedding:
    """The pipeline for the folder, the flags overriding what it says (``auto``: the folder's)."""
    if pooling not in POOLING_CHOICES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_CHOICES)}, got {pooling!r}")
    if normalize not in NORMALIZE_CHOICES:
        raise ValueError(f"embed_normalize must be one of {', '.join(NORMALIZE_CHOICES)}, "
                         f"got {normalize!r}")
    folder = Path(model_path)
    pipeline = read_pipeline(folder)
    has_sentence_transformers = (folder / "modules.json").is_file()
    if pooling != "auto":
        mode = PoolingMode(pooling)
    elif has_sentence_transformers:
        modes = pipeline.pooling_modes
        if len(modes) != 1 or modes[0] not in _FROM_SENTENCE_TRANSFORMERS:
            raise EmbeddingConfigError(
                f"{folder} pools with {'+'.join(modes)}; the native engine pools the last token "
                "or the mean (pass --pooling last|mean to choose one)")
        mode = _FROM_SENTENCE_TRANSFORMERS[modes[0]]
    else:
        mode = PoolingMode.LAST
    if normalize != "auto":
        unit = normalize == "yes"
    else:
        unit = pipeline.normalize if has_sentence_transformers else True
    return DecoderEmbedding(pooling=PoolingParams(mode=mode, normalize=unit),
                            max_seq_length=pipeline.max_seq_length,
                            do_lower_case=pipeline.do_lower_case,
                            matryoshka_dimensions=pipeline.matryoshka_dimensions)
