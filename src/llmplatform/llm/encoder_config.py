"""What an embedding model folder says about itself: is it one, and how are its vectors made.

A sentence-transformers folder describes its pipeline in ``modules.json``: a Transformer (the
encoder), a Pooling module (``1_Pooling/config.json``: which token states become the vector)
and optionally Normalize (unit vectors); ``sentence_bert_config.json`` caps the input length
(``max_seq_length``) and may lowercase the text. A bare encoder folder (a ``BertModel``
architecture, no sentence-transformers files) is embedded by mean pooling, unnormalized: what
sentence-transformers itself does with one.

Matryoshka models (whose leading components form a usable shorter vector) say so in
``config.json``: ``"matryoshka_dimensions": [768, 512, 256]`` (only those widths) or
``"is_matryoshka": true`` (any width), the keys vLLM reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Pooling modes, in the order sentence-transformers concatenates them when several are on.
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")

# Architectures that embed rather than generate (transformers' bare encoders).
_ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel", "DistilBertModel",
                          "MPNetModel", "ElectraModel", "AlbertModel", "DebertaV2Model",
                          "NomicBertModel", "ModernBertModel")
_ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra",
                        "albert", "deberta-v2", "modernbert")


class EmbeddingConfigError(ValueError):
    """The folder's sentence-transformers files ask for something this backend cannot do."""


@dataclass(frozen=True)
class EncoderPipeline:
    pooling_modes: tuple[str, ...]
    """Which of :data:`POOLING_MODES` are on, concatenated in that order."""
    normalize: bool
    max_seq_length: int | None
    """sentence_bert_config.json's cap; None: the tokenizer's and the model's limits only."""
    do_lower_case: bool
    matryoshka_dimensions: tuple[int, ...] | None
    """None: no truncation; (): any width; else the widths allowed."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EmbeddingConfigError(f"cannot read {path}: {exc}") from exc


def is_embedding_model(path: str | Path) -> bool:
    """True for a sentence-transformers folder or a bare encoder (``--backend auto``)."""
    folder = Path(path)
    if (folder / "modules.json").is_file():
        return True
    config_path = folder / "config.json"
    if not config_path.is_file():
        return False
    config = _read_json(config_path)
    architectures = config.get("architectures") or []
    if architectures:
        return all(arch in _ENCODER_ARCHITECTURES for arch in architectures)
    return config.get("model_type") in _ENCODER_MODEL_TYPES


_CROSS_ENCODER_ARCHITECTURES = tuple(arch.removesuffix("Model") + "ForSequenceClassification"
                                     for arch in _ENCODER_ARCHITECTURES)


def is_cross_encoder(path: str | Path) -> bool:
    """True for a BERT-family sequence classifier (``BertForSequenceClassification``...): a
    cross-encoder, as sentence-transformers' ``CrossEncoder`` saves one (``--backend auto``)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    architectures = _read_json(config_path).get("architectures") or []
    return bool(architectures) and all(arch in _CROSS_ENCODER_ARCHITECTURES
                                       for arch in architectures)


def read_pipeline(path: str | Path) -> EncoderPipeline:
    folder = Path(path)
    modules = _read_json(folder / "modules.json") if (folder / "modules.json").is_file() else None
    pooling_modes: tuple[str, ...] = ("mean_tokens",)
    normalize = False
    if modules is not None:
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
        if unknown:
            raise EmbeddingConfigError(
                f"{folder / 'modules.json'} has modules this backend does not run: "
                f"{sorted(unknown)} (it runs Transformer, Pooling and Normalize)")
        normalize = "Normalize" in kinds
        if "Pooling" in kinds:
            pooling_modes = _pooling_modes(folder / str(kinds["Pooling"].get("path", "1_Pooling")))
    st_config_path = folder / "sentence_bert_config.json"
    st_config = _read_json(st_config_path) if st_config_path.is_file() else {}
    max_seq_length = st_config.get("max_seq_length")
    hf_config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    return EncoderPipeline(
        pooling_modes=pooling_modes, normalize=normalize,
        max_seq_length=max_seq_length if isinstance(max_seq_length, int) and max_seq_length > 0 else None,
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        matryoshka_dimensions=_matryoshka(hf_config))


def _pooling_modes(pooling_dir: Path) -> tuple[str, ...]:
    config_path = pooling_dir / "config.json"
    if not config_path.is_file():
        return ("mean_tokens",)  # sentence-transformers' default
    config = _read_json(config_path)
    if config.get("pooling_mode_weightedmean_tokens"):
        raise EmbeddingConfigError(f"{config_path}: weighted mean pooling is not supported "
                                   f"(supported: {', '.join(POOLING_MODES)})")
    modes = tuple(mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}"))
    if not modes:
        raise EmbeddingConfigError(f"{config_path} turns no pooling mode on")
    return modes


def _matryoshka(hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = hf_config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(sorted(set(dims), reverse=True))
    if hf_config.get("is_matryoshka") is True:
        return ()
    return None
