"""Engine configuration: frozen, validated at construction, one section per component.

Each component receives only its own section (the scheduler never sees the cache's memory size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from llmplatform.errors import InvalidRequestError
from llmplatform.utils.sizes import parse_size as parse_memory_size  # '2GiB' / '512MiB' / '1.5GB' -> bytes


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    block_size: tokens per KV block (default 16).
    kv_cache_memory_bytes: bytes for the KV pool on CPU (from --kv-cache-memory).
    gpu_memory_utilization: fraction (0, 1] of GPU memory the worker may use on CUDA; the pool
        gets what is left after the weights and a profiled forward pass.
    num_blocks: an explicit block count (tests); overrides both of the above.
    enable_prefix_caching: reuse the KV blocks of a cached prefix (full blocks, matched by a
        chained hash of their tokens) instead of recomputing them; freed blocks stay cached until
        the pool needs them, least recently used first (default on).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_seqs: sequences running at once (default 64).
    max_num_batched_tokens: tokens computed per step, prefill and decode together (default 2048).
    max_model_len: the longest prompt + output a sequence may reach (tokens).
    min_in_flight_prefix_blocks: with prefix caching, a waiting sequence whose next this many (or
        more) full KV blocks after its cached prefix another sequence is computing in the current
        step waits a step for them to be cached instead of computing them again (blocks; default
        1; 0: never wait). See engine.scheduler, "Prefixes in flight".
    background_slowdown: while foreground requests are unfinished, how much longer background
        requests (priority >= protocol.worker.BACKGROUND_PRIORITY, the gateway's batch lines)
        may make a step, as a fraction of its duration without them (default 0.2; 0: they get
        nothing then). Measured step by step (engine.background).
    background_max_step_tokens: the most tokens a step gives background requests when no
        foreground one is unfinished (default 256): what an arriving interactive request may
        wait behind.
    background_grace_s: for this long after foreground work (seconds, default 1), background
        requests keep the share they get beside it, so the next interactive request, likely
        soon, does not wait behind a big step.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    min_in_flight_prefix_blocks: int = 1
    background_slowdown: float = 0.2
    background_max_step_tokens: int = 256
    background_grace_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.background_slowdown < 0:
            raise ValueError(f"background_slowdown must be at least 0, got {self.background_slowdown}")
        if self.background_grace_s < 0:
            raise ValueError(f"background_grace_s must be at least 0, got {self.background_grace_s}")
        if self.background_max_step_tokens < 1:
            raise ValueError("background_max_step_tokens must be at least 1, got "
                             f"{self.background_max_step_tokens}")
        if self.min_in_flight_prefix_blocks < 0:
            raise ValueError("min_in_flight_prefix_blocks must be at least 0, got "
                             f"{self.min_in_flight_prefix_blocks}")


COMPUTE_DTYPES = ("auto", "model", "float32")
"""Choices for the dtype the native engine multiplies matrices in (``--compute-dtype``)."""

DECODE_PATHS = ("auto", "eager", "fused")
"""Choices for how the native engine runs the few rows of a decode step (``--decode-path``):
see ``engine.decode_path``."""

BLOCKED_LINEAR_CHOICES = ("auto", "on", "off")
"""Choices for whether batched decode steps (17-64 rows) multiply on the blocked AVX2 kernel
(``--blocked-linear``): see ``engine.decode_path``."""

ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
ATTENTION_BACKEND_ENV_VAR = "LLMPLATFORM_ATTENTION_BACKEND"
"""Forces an attention backend (``kernels``); read once, when a ``ModelConfig`` is made."""


def attention_backend_from_env() -> str:
    return os.environ.get(ATTENTION_BACKEND_ENV_VAR, "").strip().lower() or "auto"


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, on which device, in which dtype; ``compute_dtype`` is the dtype of the
    matrix products (``auto``, ``model`` or ``float32``: see ``torch_utils.resolve_compute_dtype``);
    ``decode_path`` how small-row steps run (``auto``, ``eager`` or ``fused``: see
    ``engine.decode_path``); ``blocked_linear`` whether products of 17-64 rows run on the blocked
    AVX2 kernel (``auto``, ``on``, ``off``: likewise); ``quantized_gguf`` the GGUF file
    ``model_path`` was converted from, whose projections then stay in their block formats (``--quantization gguf``:
    ``models.quantized``), or None for dense weights; ``attention_backend`` the attention
    kernels (``auto``, or one forced: ``LLMPLATFORM_ATTENTION_BACKEND``, read here);
    ``enforce_eager`` never replays decode steps from CUDA graphs (``engine.cuda_graphs``; they
    are only captured on CUDA, without tensor or pipeline parallelism)."""

    model_path: str
    model_names: tuple[str, ...]
    device: str = "auto"
    dtype: str = "auto"
    compute_dtype: str = "auto"
    decode_path: str = "auto"
    blocked_linear: str = "auto"
    quantized_gguf: str | None = None
    attention_backend: str = field(default_factory=attention_backend_from_env)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                             f"got {self.compute_dtype!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {', '.join(DECODE_PATHS)}, "
                             f"got {self.decode_path!r}")
        if self.blocked_linear not in BLOCKED_LINEAR_CHOICES:
            raise ValueError(f"blocked_linear must be one of {', '.join(BLOCKED_LINEAR_CHOICES)}, "
                             f"got {self.blocked_linear!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend ({ATTENTION_BACKEND_ENV_VAR}) must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")


DEFAULT_RANK_TIMEOUT_S = 60.0
DEFAULT_RANK_START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism of the native engine (``engine.parallel``).

    tensor_parallel_size: ranks the model is split over, each holding 1/N of the heads, the MLP
        and the vocabulary, and the KV cache of its heads (default 1: one process, no process
        group). Rank 0 is the engine's own process; ranks 1..N-1 are processes it starts. The
        attention heads and key/value heads must divide by it.
    rank_timeout_s: how long rank 0 waits on the other ranks within a step (an all-reduce, the
        logits' gather) before the step fails, so a rank that hangs fails the engine instead of
        stalling it (a rank that dies is noticed at once); default 60 s.
    rank_start_timeout_s: how long starting the other ranks (importing torch, loading their
        shards) may take (default 600 s; a rank that exits meanwhile fails the start at once).
    pipeline_parallel_size: stages the decoder layers are split into, each an equal contiguous
        range on ``tensor_parallel_size`` ranks of its own (P x T ranks in all), with as many
        virtual engines (schedulers with their share of the KV cache) whose steps overlap in
        the stages (default 1: no stages). The layers must divide by it.
    """

    tensor_parallel_size: int = 1
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S
    rank_start_timeout_s: float = DEFAULT_RANK_START_TIMEOUT_S
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        """Ranks in all (1: this process alone)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}")
        if self.rank_timeout_s <= 0 or self.rank_start_timeout_s <= 0:
            raise ValueError("rank_timeout_s and rank_start_timeout_s must be positive")


@dataclass(frozen=True)
class RestartConfig:
    """Rebuilding the engine in-process after a step fails in a way no single request explains.

    max_restarts_per_minute: rebuilds allowed within any 60 s; the failure after that many is
        final (the engine reports itself dead and a worker in service mode exits non-zero, so a
        supervisor starts a fresh process). 0: never rebuild (default 3).
    """

    max_restarts_per_minute: int = 3

    def __post_init__(self) -> None:
        if self.max_restarts_per_minute < 0:
            raise ValueError("max_restarts_per_minute must be at least 0, got "
                             f"{self.max_restarts_per_minute}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (engine.lora).

    enabled: give the model's projections adapter slots (default False: no LoRA, no cost).
    max_loras: adapters resident at once, one slot each (default 4): the adapters of the running
        sequences never outnumber them (a request whose adapter finds no slot waits).
    max_lora_rank: the largest rank an adapter may have (default 16; the slots' width).
    """

    enabled: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
"""Speculative decoding methods the native engine runs (``--speculative-config``'s ``method``)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine.speculative): each step, a decoding sequence's next tokens are
    guessed cheaply and checked in one forward pass of the model, which keeps the ones it would
    have produced itself (greedy: the same tokens; sampling: the same distribution).

    method: how tokens are proposed; ``ngram`` (prompt lookup): the tokens that followed the
        latest earlier occurrence of the sequence's last n tokens (in its prompt and output);
        ``draft_model``: a smaller model of the same tokenizer (``model``) generates them, run by
        the same engine with a KV pool of its own. Given ``model`` and no ``method``, the method is
        ``draft_model`` (as in vLLM).
    model: the draft model (a local directory, hub id or .gguf, like ``--model``; resolved to a
        directory before the engine is made); only with ``draft_model``.
    num_speculative_tokens: tokens proposed per sequence and step, K (each verification forward
        computes K + 1 positions per sequence; default 4).
    prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram matched (tokens;
        longer first; defaults 4 and 2; ``ngram`` only).
    disable_by_batch_size: speculation is off for a step when more sequences than this are
        decoding (a big batch is no longer memory bound, so verifying K extra positions per
        sequence costs compute the accepted tokens do not repay; default 8).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 8
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("--speculative-config: method draft_model needs a model (the draft "
                             "checkpoint), and only it takes one")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [1, 64], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_json(cls, text: str | dict) -> SpeculativeConfig:
        """The ``--speculative-config`` JSON object (vLLM's keys); ValueError naming what is wrong."""
        import json

        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unsupported key(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(sorted(known))})")
        for key, value in data.items():
            if key in ("method", "model"):
                if not isinstance(value, str) or not value:
                    raise ValueError(f"--speculative-config: {key} must be a non-empty string, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
        if "model" in data and "method" not in data:
            data["method"] = "draft_model"
        return cls(**data)

    def check_supported(self, config: EngineConfig) -> None:
        """Refuses, before anything starts, the engine settings speculation does not run with."""
        refused = []
        if config.parallel.pipeline_parallel_size > 1:
            refused.append("pipeline parallelism (--pipeline-parallel-size > 1)")
        if config.parallel.tensor_parallel_size > 1:
            refused.append("tensor parallelism (--tensor-parallel-size > 1)")
        if config.lora.enabled:
            refused.append("LoRA adapters (--enable-lora / --lora-modules)")
        if refused:
            raise ValueError("--speculative-config does not combine with " + ", ".join(refused)
                             + " yet")


# ``--async-output-processing`` (engine.output_pipeline): auto (on for CUDA), on, off.
ASYNC_OUTPUT_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    restart: RestartConfig = RestartConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig = LoRAConfig()
    # Speculative decoding (engine.speculative); None: off.
    speculative: SpeculativeConfig | None = None
    # Detokenizing and stop strings overlapped with the next step (engine.output_pipeline):
    # "auto" (on for CUDA, off on CPU, as measured), "on" or "off".
    async_output_processing: str = "auto"

    def __post_init__(self) -> None:
        if self.async_output_processing not in ASYNC_OUTPUT_MODES:
            raise ValueError(f"async_output_processing must be one of "
                             f"{', '.join(ASYNC_OUTPUT_MODES)}, got {self.async_output_processing!r}")
        if self.speculative is not None:
            self.speculative.check_supported(self)
        if self.lora.enabled and self.parallel.pipeline_parallel_size > 1:
            # Each stage would need its layers' adapter shares and each step's adapter rows.
            raise ValueError("LoRA adapters are not served with pipeline parallelism yet "
                             "(--pipeline-parallel-size 1, or no --enable-lora / --lora-modules)")


__all__ = ["ASYNC_OUTPUT_MODES", "BLOCKED_LINEAR_CHOICES", "COMPUTE_DTYPES", "DECODE_PATHS", "CacheConfig", "SchedulerConfig",
           "ModelConfig", "EngineConfig", "ParallelConfig", "RestartConfig", "LoRAConfig", "SpeculativeConfig",
           "parse_memory_size", "InvalidRequestError"]
