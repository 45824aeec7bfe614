"""Settings to a backend: the one place that turns a backend's settings into a built `LLMBackend`
(:func:`build_backend`, for the model worker) or into the native engine's config
(:func:`paged_engine_config`, for the worker's paged backend and for the offline ``LLM``).

`BackendConfig` is the table of backend settings: each field's name is the worker's flag (and
``LLMPLATFORM_<FLAG>``, ``[[worker]]`` key and offline ``LLM`` keyword) and its value the default
those take (``model_worker/settings.py`` and ``offline.py`` read them from here). The engine's
settings take their defaults from the engine's own config sections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from llmplatform.engine.config import (
    BLOCKED_LINEAR_CHOICES,
    COMPUTE_DTYPES,
    ASYNC_OUTPUT_MODES,
    DECODE_PATHS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_memory_size,
)
from llmplatform.llm.base import LLMBackend
from llmplatform.llm.decoder_embedding import NORMALIZE_CHOICES, POOLING_CHOICES
from llmplatform.llm.resolve import QUANTIZATIONS, resolve_model

if TYPE_CHECKING:
    from llmplatform.engine.model_runner import RunnerFactory
    from llmplatform.sampling.grammar import GrammarConfig

__all__ = ["ASYNC_OUTPUT_MODES", "BACKENDS", "BLOCKED_LINEAR_CHOICES", "COMPUTE_DTYPES", "DECODE_PATHS", "NORMALIZE_CHOICES",
           "POOLING_CHOICES", "QUANTIZATIONS", "TASKS", "BackendConfig", "build_backend", "paged_engine_config"]

logger = logging.getLogger("llmplatform.worker")

BACKENDS = ("auto", "paged", "hf", "encoder")
TASKS = ("auto", "generate", "embed", "score")


@dataclass(frozen=True)
class BackendConfig:
    model_path: str | None = None
    model_names: tuple[str, ...] | None = None
    backend: str = "auto"
    device: str = ModelConfig.device
    dtype: str = ModelConfig.dtype
    compute_dtype: str = ModelConfig.compute_dtype  # paged backend only
    decode_path: str = ModelConfig.decode_path  # paged backend only
    blocked_linear: str = ModelConfig.blocked_linear  # paged backend only
    quantization: str = "none"  # paged backend only: gguf keeps a GGUF's projection blocks
    enforce_eager: bool = ModelConfig.enforce_eager  # paged backend only: no CUDA graphs
    max_concurrency: int | None = None  # hf: forward passes at once (default 5)
    max_model_len: int | None = None  # None: the model's context length
    # Native engine (paged backend) only.
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    tensor_parallel_timeout: float = ParallelConfig.rank_timeout_s  # seconds a step waits on the other ranks
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size  # stages (engine.virtual_engines)
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    background_slowdown: float = SchedulerConfig.background_slowdown  # engine.background
    background_max_step_tokens: int = SchedulerConfig.background_max_step_tokens
    background_grace_s: float = SchedulerConfig.background_grace_s
    block_size: int = CacheConfig.block_size
    kv_cache_memory: str = "2GiB"  # CacheConfig.kv_cache_memory_bytes, as a size to read
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    # Speculative decoding (engine.speculative), vLLM's --speculative-config JSON; None: off.
    speculative_config: str | None = None
    # Detokenizing and stop strings overlapped with the next step (engine.output_pipeline).
    async_output_processing: str = EngineConfig.async_output_processing
    # Run Python code shipped with a checkpoint (HF `trust_remote_code`); hf backend only, since
    # the paged backend serves only its own built-in architectures.
    trust_remote_code: bool = False
    # Tool calling (llm.tool_support): a chat template file replacing the model's, and the
    # tool-call syntax; None: decided from the model's own template.
    chat_template: str | None = None
    tool_call_parser: str | None = None
    # A reasoning model's thoughts syntax (protocol.reasoning), announced to the gateway.
    reasoning_parser: str | None = None
    # Embedding models (encoder backend): cross-request batching (llm.embed_batcher).
    embed_max_batch_tokens: int | None = None  # None: by device (encoder_batch_tokens)
    embed_batch_wait_ms: float = 2.0
    # What the worker serves: generate, embed, or auto (embed for an embedding model folder).
    # A decoder served with embed runs the paged engine's pooling mode (llm.decoder_embedding):
    # pooling auto|last|mean and embed_normalize auto|yes|no (auto: what the folder says).
    task: str = "auto"
    pooling: str = "auto"
    embed_normalize: str = "auto"
    # Structured outputs (sampling.grammar): the per-token mask budget, the compiled-grammar
    # cache's size, a compile's time limit.
    grammar_token_budget_ms: float = 250.0
    grammar_cache_memory: str = "128MiB"
    grammar_compile_timeout: float = 10.0
    # LoRA adapters (engine.lora): slots on the projections (enable_lora, or implied by
    # lora_modules), loaded at start as "name=path" (lora_modules) or at runtime.
    enable_lora: bool = False
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    lora_modules: tuple[str, ...] = ()

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


def parse_lora_modules(modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """``--lora-modules`` entries, ``name=path`` each, as (name, path); ValueError otherwise."""
    pairs = []
    for entry in modules:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path, not {entry!r}")
        pairs.append((name.strip(), path.strip()))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return pairs


def build_backend(config: BackendConfig, *,
                  runner_factory: RunnerFactory | None = None) -> LLMBackend:
    """Resolves the model (local dir, hub id, .gguf, or the embedded default), loads it, and
    sets its chat template and tool-call syntax.

    ``runner_factory``: builds the paged engine's model runner instead of the default
    (``engine.model_runner.RunnerFactory``); the fault tests pass one that injects faults. Only
    with ``backend="paged"``, the one backend that has a runner."""
    from llmplatform.llm.tool_support import check_tool_flags, configure_tool_support

    if config.speculative_config is not None:
        # A bad value fails before anything loads; only the native engine speculates.
        SpeculativeConfig.from_json(config.speculative_config)
        if config.backend not in ("auto", "paged"):
            raise ValueError(f"--speculative-config runs on the native engine (--backend paged), "
                             f"not --backend {config.backend}")
        if config.task == "embed":
            raise ValueError("--speculative-config does not combine with --task embed")
    if runner_factory is not None and config.backend != "paged":
        raise ValueError(f"a runner_factory needs backend='paged', not {config.backend!r}")
    template = check_tool_flags(config.chat_template, config.tool_call_parser)  # before loading
    grammar_config = _grammar_config(config)  # before loading: a bad size fails at once
    lora_modules = parse_lora_modules(config.lora_modules)  # likewise
    llm = _load(config, runner_factory)
    llm.load_lora_modules(lora_modules)
    llm.grammar_config = grammar_config
    configure_tool_support(llm, chat_template=template, template_source=config.chat_template,
                           tool_call_parser=config.tool_call_parser)
    llm.reasoning_parser = config.reasoning_parser
    return llm


def _grammar_config(config: BackendConfig) -> GrammarConfig:
    from llmplatform.sampling.grammar import GrammarConfig

    cache_bytes = parse_memory_size(config.grammar_cache_memory)
    return GrammarConfig(max_cache_bytes=cache_bytes,
                         max_grammar_bytes=min(GrammarConfig.max_grammar_bytes, cache_bytes),
                         compile_timeout_s=config.grammar_compile_timeout,
                         token_budget_s=config.grammar_token_budget_ms / 1000)


def _load(config: BackendConfig, runner_factory: RunnerFactory | None) -> LLMBackend:
    from llmplatform.llm.resolve import quantized_gguf, resolve_model

    if config.task not in TASKS:
        raise ValueError(f"unknown task {config.task!r}; choose from {', '.join(TASKS)}")
    resolved = resolve_model(config.model_path)
    gguf = quantized_gguf(resolved, config.quantization)  # None unless --quantization gguf
    if gguf is not None and config.tensor_parallel_size > 1:
        raise ValueError("--quantization gguf does not combine with --tensor-parallel-size > 1 yet")
    if gguf is not None and config.pipeline_parallel_size > 1:
        raise ValueError("--quantization gguf does not combine with --pipeline-parallel-size > 1 yet")
    names = config.model_names or (resolved.name,)
    backend = config.backend
    model_config, reason = (_paged_config(config, resolved.path) if backend in ("auto", "paged")
                            else (None, None))
    # A bare decoder (MistralModel: e5-mistral) has no LM head: it can only embed.
    headless = reason is None and model_config is not None and _is_headless(model_config)
    if backend in ("auto", "encoder") and _is_cross_encoder(resolved.path):
        if config.task not in ("auto", "score"):
            raise ValueError(f"{resolved.path} is a cross-encoder (reranker): it serves scores "
                             f"(--task score), not --task {config.task}")
        _no_pooling_flags(config, "a cross-encoder pools nothing")
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size run on the paged "
                             "backend, not encoder")
        return _build_encoder(config, str(resolved.path), names, cross_encoder=True)
    if config.task == "score":
        raise ValueError(f"--task score serves cross-encoders (BertForSequenceClassification and "
                         f"its family); {resolved.path} is none (an embedding model scores "
                         "without it, by cosine)")
    embedding_folder = headless or _is_embedding_model(resolved.path)
    task = config.task if config.task != "auto" else "embed" if embedding_folder else "generate"
    if headless and task == "generate":
        raise ValueError(f"{resolved.path} is a bare decoder with no LM head ("
                         f"{', '.join(model_config.architectures)}): it serves embeddings only "
                         "(--task embed)")
    # An embedding folder whose network is a decoder the engine runs (gte-Qwen2) goes to the
    # engine's pooling mode; an encoder (BERT family) to the encoder backend.
    if backend == "encoder" or backend == "auto" and embedding_folder and reason is not None:
        if task == "generate":
            raise ValueError(f"{resolved.path} is an embedding model: it serves no generation "
                             "(--task generate)")
        _no_pooling_flags(config, "the encoder backend follows the folder's sentence-transformers "
                                  "configuration")
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size run on the paged "
                             "backend, not encoder")
        if config.speculative_config is not None:
            raise ValueError("--speculative-config runs on the native engine, not the encoder "
                             "backend")
        return _build_encoder(config, str(resolved.path), names)
    if task == "embed" and backend == "hf":
        raise ValueError("--task embed runs on the paged backend (decoders) or the encoder "
                         "backend (BERT family), not hf")
    if task != "embed":
        _no_pooling_flags(config, "they apply to --task embed")
    if backend in ("auto", "paged"):
        if reason is None:
            backend = "paged"
        elif backend == "paged":
            raise ValueError(f"the paged backend cannot serve {resolved.path}: {reason}")
        else:
            logger.info("using the hf backend: %s", reason)
            backend = "hf"
    if backend != "paged" and config.tensor_parallel_size > 1:
        raise ValueError(f"--tensor-parallel-size runs on the paged backend, not {backend}")
    if backend != "paged" and config.pipeline_parallel_size > 1:
        raise ValueError(f"--pipeline-parallel-size runs on the paged backend, not {backend}")
    if task == "embed" and config.pipeline_parallel_size > 1:
        # The last stage returns only the rows' logits, never the hidden states pooling reads.
        raise ValueError("--task embed does not combine with --pipeline-parallel-size > 1 yet")
    if backend == "paged":
        return _build_paged(config, str(resolved.path), names, embed=task == "embed",
                            quantized_gguf=None if gguf is None else str(gguf),
                            runner_factory=runner_factory)
    if gguf is not None:
        raise ValueError(f"--quantization gguf runs on the paged backend, not {backend}")
    if task == "embed":
        raise ValueError(f"--task embed needs the paged backend for this decoder, which cannot "
                         f"serve {resolved.path}: {reason}")
    if config.speculative_config is not None:
        raise ValueError(f"--speculative-config runs on the native engine (--backend paged), "
                         f"which cannot serve {resolved.path}: {reason}")
    if backend == "hf":
        from llmplatform.llm.hf import HFTransformersLLM

        return HFTransformersLLM(str(resolved.path), names, device=config.device,
                                 dtype=config.dtype, max_concurrency=config.max_concurrency or 5,
                                 max_model_len=config.max_model_len,
                                 trust_remote_code=config.trust_remote_code,
                                 enable_lora=config.lora_enabled, max_lora_rank=config.max_lora_rank)
    raise ValueError(f"unknown backend {config.backend!r}; choose from {', '.join(BACKENDS)}")


def _paged_config(config: BackendConfig, path: object) -> tuple[Any, str | None]:
    """(the folder's HF config, why the paged backend cannot run it or None)."""
    from transformers import AutoConfig

    from llmplatform.models.registry import unsupported_reason

    try:
        model_config = AutoConfig.from_pretrained(str(path),
                                                  trust_remote_code=config.trust_remote_code)
    except Exception as exc:  # e.g. an encoder whose config needs its own code
        return None, f"its config.json does not load ({type(exc).__name__}: {exc})"
    return model_config, unsupported_reason(model_config)


def _is_headless(model_config: Any) -> bool:
    from llmplatform.models.registry import is_headless

    return is_headless(model_config)


def _no_pooling_flags(config: BackendConfig, why: str) -> None:
    given = [f"--{name.replace('_', '-')} {value}" for name, value in
             (("pooling", config.pooling), ("embed_normalize", config.embed_normalize))
             if value != "auto"]
    if given:
        raise ValueError(f"{' and '.join(given)}: not for this worker ({why})")


def _is_embedding_model(path: object) -> bool:
    from llmplatform.llm.encoder_config import is_embedding_model

    return is_embedding_model(str(path))


def _is_cross_encoder(path: object) -> bool:
    from llmplatform.llm.encoder_config import is_cross_encoder

    return is_cross_encoder(str(path))


def _build_encoder(config: BackendConfig, path: str, names: tuple[str, ...], *,
                   cross_encoder: bool = False) -> LLMBackend:
    from llmplatform.llm.cross_encoder import CrossEncoderLLM
    from llmplatform.llm.embed_batcher import BatchingConfig
    from llmplatform.llm.encoder import EncoderEmbeddingLLM

    batching = BatchingConfig(
        max_batch_tokens=config.embed_max_batch_tokens or encoder_batch_tokens(config.device),
        max_wait_s=config.embed_batch_wait_ms / 1000)
    backend_class = CrossEncoderLLM if cross_encoder else EncoderEmbeddingLLM
    return backend_class(path, names, device=config.device, dtype=config.dtype,
                         max_model_len=config.max_model_len, batching=batching,
                         trust_remote_code=config.trust_remote_code)


CPU_ENCODER_BATCH_TOKENS = 1024
"""Tokens per encoder forward pass on CPU (padded tokens; the tokens themselves for an encoder
that packs its inputs, see llm/encoder.py). Measured padded: all-MiniLM-L6-v2 on 2 cores, 512 sentences
of 1-60 words, sentences/s by bound: all of them length-sorted (many small requests batched
together) 140 at 512, 150 at 1024, 153 at 2048, 137 at 4096, 111 at 8192, 91 at 16384 (a large
batch's activations outgrow the caches); 32 sentences at a time, as one request of 32 brings
them (sorted within it) 106 at 512, 105 at 1024, 84 at 2048, 74 at 4096 (fewer, wider batches
pad short inputs to long ones). A GPU wants large batches."""
GPU_ENCODER_BATCH_TOKENS = 16384


def encoder_batch_tokens(device: str) -> int:
    """The default `--embed-max-batch-tokens` for an encoder on `device`."""
    from llmplatform.utils.torch_utils import resolve_device

    return GPU_ENCODER_BATCH_TOKENS if resolve_device(device).type == "cuda" else CPU_ENCODER_BATCH_TOKENS


def _build_paged(config: BackendConfig, path: str, names: tuple[str, ...], *, embed: bool = False,
                 quantized_gguf: str | None = None,
                 runner_factory: RunnerFactory | None = None) -> LLMBackend:
    from llmplatform.engine.model_runner import ModelRunner
    from llmplatform.llm.paged import PagedLLM

    engine_config = _engine_config(config, path, names, quantized_gguf=quantized_gguf)
    embedding = None
    if embed:
        from llmplatform.llm.decoder_embedding import decoder_embedding

        embedding = decoder_embedding(path, config.pooling, config.embed_normalize)
    return PagedLLM(engine_config, embedding,
                    runner_factory=runner_factory or ModelRunner.from_config)


def paged_engine_config(config: BackendConfig, *, num_blocks: int | None = None) -> EngineConfig:
    """The native engine's config for `config`'s model (resolved as the worker resolves it: local
    dir, hub id, .gguf or the embedded default). `num_blocks` fixes the KV cache's block count
    instead of sizing it from `kv_cache_memory` (offline use and tests)."""
    from llmplatform.llm.resolve import quantized_gguf, resolve_model

    resolved = resolve_model(config.model_path)
    gguf = quantized_gguf(resolved, config.quantization)
    return _engine_config(config, str(resolved.path), config.model_names or (resolved.name,),
                          quantized_gguf=None if gguf is None else str(gguf), num_blocks=num_blocks)


def _engine_config(config: BackendConfig, path: str, names: tuple[str, ...], *,
                   quantized_gguf: str | None, num_blocks: int | None = None) -> EngineConfig:
    from transformers import AutoConfig

    from llmplatform.models.registry import max_model_len

    model_len = max_model_len(AutoConfig.from_pretrained(path))
    if config.max_model_len is not None:
        if config.max_model_len > model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's context "
                             f"length {model_len}")
        model_len = config.max_model_len
    return EngineConfig(
        model=ModelConfig(model_path=path, model_names=names, device=config.device,
                          dtype=config.dtype, compute_dtype=config.compute_dtype,
                          decode_path=config.decode_path, blocked_linear=config.blocked_linear,
                          quantized_gguf=quantized_gguf, enforce_eager=config.enforce_eager),
        cache=CacheConfig(block_size=config.block_size,
                          kv_cache_memory_bytes=parse_memory_size(config.kv_cache_memory),
                          gpu_memory_utilization=config.gpu_memory_utilization,
                          num_blocks=num_blocks, enable_prefix_caching=config.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=model_len,
                                  background_slowdown=config.background_slowdown,
                                  background_max_step_tokens=config.background_max_step_tokens,
                                  background_grace_s=config.background_grace_s),
        parallel=ParallelConfig(tensor_parallel_size=config.tensor_parallel_size,
                                rank_timeout_s=config.tensor_parallel_timeout,
                                pipeline_parallel_size=config.pipeline_parallel_size),
        lora=LoRAConfig(enabled=config.lora_enabled, max_loras=config.max_loras,
                        max_lora_rank=config.max_lora_rank),
        speculative=_speculative(config.speculative_config),
        async_output_processing=config.async_output_processing)


def _speculative(text: str | None) -> SpeculativeConfig | None:
    """``--speculative-config``, its draft model (if any) resolved like ``--model`` to a directory."""
    if text is None:
        return None
    spec = SpeculativeConfig.from_json(text)
    if spec.model is None:
        return spec
    return replace(spec, model=str(resolve_model(spec.model).path))
