"""Choosing and building a worker's backend from its flags (one place for every entry point)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmplatform.llm.base import LLM

logger = logging.getLogger("llmplatform.worker")

BACKENDS = ("auto", "hf")


@dataclass(frozen=True)
class BackendConfig:
    model_path: str | None = None
    model_names: tuple[str, ...] | None = None
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    max_concurrency: int = 5
    max_model_len: int | None = None


def build_llm(config: BackendConfig) -> LLM:
    """Resolves the model (local dir, hub id, .gguf, or the embedded default) and loads it."""
    from llmplatform.llm.resolve import resolve_model

    resolved = resolve_model(config.model_path)
    names = config.model_names or (resolved.name,)
    backend = config.backend
    if backend == "auto":
        backend = "hf"
    if backend == "hf":
        from llmplatform.llm.hf import HFTransformersLLM

        return HFTransformersLLM(str(resolved.path), names, device=config.device,
                                 dtype=config.dtype, max_concurrency=config.max_concurrency,
                                 max_model_len=config.max_model_len)
    raise ValueError(f"unknown backend {config.backend!r}; choose from {', '.join(BACKENDS)}")
