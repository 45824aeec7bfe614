"""Choosing and building a worker's backend from its flags (one place for every entry point)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmplatform.llm.base import LLMBackend

logger = logging.getLogger("llmplatform.worker")

BACKENDS = ("auto", "paged", "hf", "encoder")


@dataclass(frozen=True)
class BackendConfig:
    model_path: str | None = None
    model_names: tuple[str, ...] | None = None
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    compute_dtype: str = "auto"  # paged backend only
    max_concurrency: int | None = None  # hf: forward passes at once (default 5)
    max_model_len: int | None = None
    # Native engine (paged backend) only.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: str = "2GiB"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Run Python code shipped with a checkpoint (HF `trust_remote_code`); hf backend only, since
    # the paged backend serves only its own built-in architectures.
    trust_remote_code: bool = False
    # Tool calling (llm.tool_support): a chat template file replacing the model's, and the
    # tool-call syntax; None: decided from the model's own template.
    chat_template: str | None = None
    tool_call_parser: str | None = None
    # Embedding models (encoder backend): cross-request batching (llm.embed_batcher).
    embed_max_batch_tokens: int = 16384
    embed_batch_wait_ms: float = 2.0


def build_llm(config: BackendConfig) -> LLMBackend:
    """Resolves the model (local dir, hub id, .gguf, or the embedded default), loads it, and
    sets its chat template and tool-call syntax."""
    from llmplatform.llm.tool_support import check_tool_flags, configure_tool_support

    template = check_tool_flags(config.chat_template, config.tool_call_parser)  # before loading
    llm = _load(config)
    configure_tool_support(llm, chat_template=template, template_source=config.chat_template,
                           tool_call_parser=config.tool_call_parser)
    return llm


def _load(config: BackendConfig) -> LLMBackend:
    from llmplatform.llm.resolve import resolve_model

    resolved = resolve_model(config.model_path)
    names = config.model_names or (resolved.name,)
    backend = config.backend
    if backend == "encoder" or backend == "auto" and _is_embedding_model(resolved.path):
        return _build_encoder(config, str(resolved.path), names)
    if backend in ("auto", "paged"):
        from transformers import AutoConfig

        from llmplatform.models.registry import unsupported_reason

        reason = unsupported_reason(AutoConfig.from_pretrained(
            str(resolved.path), trust_remote_code=config.trust_remote_code))
        if reason is None:
            backend = "paged"
        elif backend == "paged":
            raise ValueError(f"the paged backend cannot serve {resolved.path}: {reason}")
        else:
            logger.info("using the hf backend: %s", reason)
            backend = "hf"
    if backend == "paged":
        return _build_paged(config, str(resolved.path), names)
    if backend == "hf":
        from llmplatform.llm.hf import HFTransformersLLM

        return HFTransformersLLM(str(resolved.path), names, device=config.device,
                                 dtype=config.dtype, max_concurrency=config.max_concurrency or 5,
                                 max_model_len=config.max_model_len,
                                 trust_remote_code=config.trust_remote_code)
    raise ValueError(f"unknown backend {config.backend!r}; choose from {', '.join(BACKENDS)}")


def _is_embedding_model(path: object) -> bool:
    from llmplatform.llm.encoder_config import is_embedding_model

    return is_embedding_model(str(path))


def _build_encoder(config: BackendConfig, path: str, names: tuple[str, ...]) -> LLMBackend:
    from llmplatform.llm.embed_batcher import BatchingConfig
    from llmplatform.llm.encoder import EncoderEmbeddingLLM

    batching = BatchingConfig(max_batch_tokens=config.embed_max_batch_tokens,
                              max_wait_s=config.embed_batch_wait_ms / 1000)
    return EncoderEmbeddingLLM(path, names, device=config.device, dtype=config.dtype,
                               max_model_len=config.max_model_len, batching=batching,
                               trust_remote_code=config.trust_remote_code)


def _build_paged(config: BackendConfig, path: str, names: tuple[str, ...]) -> LLMBackend:
    from transformers import AutoConfig

    from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig,
                                           SchedulerConfig, parse_memory_size)
    from llmplatform.llm.paged import PagedLLM
    from llmplatform.models.registry import max_model_len

    model_len = max_model_len(AutoConfig.from_pretrained(path))
    if config.max_model_len is not None:
        if config.max_model_len > model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's context "
                             f"length {model_len}")
        model_len = config.max_model_len
    engine_config = EngineConfig(
        model=ModelConfig(model_path=path, model_names=names, device=config.device,
                          dtype=config.dtype, compute_dtype=config.compute_dtype),
        cache=CacheConfig(block_size=config.block_size,
                          kv_cache_memory_bytes=parse_memory_size(config.kv_cache_memory),
                          gpu_memory_utilization=config.gpu_memory_utilization,
                          enable_prefix_caching=config.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=model_len))
    return PagedLLM(engine_config)
