"""The serverless worker's configuration: environment variables only, read once at startup.

Names follow RunPod's vLLM worker (runpod-workers/worker-vllm) wherever one of its variables
means something we have; ours (BACKEND, DEVICE, ...) are in the same table, `VARIABLES`, which
docs/serverless.md lists row for row (a unit test keeps the two equal). Variables that become the
model worker's flags are checked by the worker's own settings model (read by name, as `serve`
does: services never import each other) before anything starts, so a bad value is an error
naming the variable, not a worker that dies during startup.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmplatform.serve.launcher import service_settings_models
from llmplatform.utils.settings import SettingsError, argv_for

DEFAULT_BATCH_SIZE = 50
DEFAULT_MIN_BATCH_SIZE = 1
DEFAULT_BATCH_SIZE_GROWTH_FACTOR = 3.0
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_REQUEST_TIMEOUT_S = 3600.0


class ConfigError(ValueError):
    """A variable with a value we cannot use; the message names it."""


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str
    worker_setting: str | None = None
    """The model worker setting (flag) it becomes; None for the handler's own variables."""
    convert: Callable[[str], object] | None = None
    """Turns the text into the worker setting's value where the spellings differ from ours."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(name: str, text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"${name}={text!r}: expected 1/0 or true/false")


def _dtype(text: str) -> str:
    # vLLM's spellings: `half` and `float` are float16 and float32.
    return {"half": "float16", "float": "float32"}.get(text.strip().lower(), text.strip().lower())


def _lora_modules(text: str) -> list[str]:
    """worker-vllm's JSON (`[{"name": ..., "path": ...}]`, or one object) as NAME=PATH items."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"$LORA_MODULES is not JSON: {exc}") from None
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, dict) and isinstance(i.get("name"), str)
               and isinstance(i.get("path"), str) for i in items):
        raise ConfigError('$LORA_MODULES: expected [{"name": "...", "path": "..."}, ...]')
    return [f"{item['name']}={item['path']}" for item in items]


VARIABLES: tuple[Variable, ...] = (
    # worker-vllm's names.
    Variable("MODEL_NAME", "the packaged SmolLM2-135M-Instruct",
             "the model: a local HF folder, a hub id (`HF_TOKEN`, `HF_HUB_OFFLINE` apply) or a "
             "`.gguf` file", "model_path"),
    Variable("OPENAI_SERVED_MODEL_NAME_OVERRIDE", "`MODEL_NAME` (unset: the default model's "
             "name)", "the name the model is served under (the `model` of OpenAI requests)",
             "model_names"),
    Variable("MAX_MODEL_LEN", "the model's context", "cap on prompt + output tokens",
             "max_model_len"),
    Variable("DTYPE", "`auto`", "`auto`, `bfloat16`, `float16` (`half`), `float32` (`float`)",
             "dtype", _dtype),
    Variable("TENSOR_PARALLEL_SIZE", "`1`", "ranks the model is split over (native engine)",
             "tensor_parallel_size"),
    Variable("QUANTIZATION", "`none`", "`gguf` keeps a GGUF model's projections quantized "
             "(native engine, CPU); vLLM's methods (`awq`, `gptq`, `fp8`...) are not ours and are "
             "refused at startup", "quantization"),
    Variable("ENABLE_PREFIX_CACHING", "`1`", "reuse the KV cache of prompt prefixes seen before",
             "enable_prefix_caching"),
    Variable("MAX_NUM_SEQS", "`64`", "sequences the native engine batches together at most "
             "(also the default `MAX_CONCURRENCY`)", "max_num_seqs"),
    Variable("MAX_NUM_BATCHED_TOKENS", "`2048`", "tokens computed per engine step",
             "max_num_batched_tokens"),
    Variable("GPU_MEMORY_UTILIZATION", "`0.9`", "share of GPU memory for weights, activations "
             "and the KV pool", "gpu_memory_utilization"),
    Variable("BLOCK_SIZE", "`16`", "tokens per KV-cache block", "block_size"),
    Variable("TRUST_REMOTE_CODE", "`0`", "run Python code shipped with a checkpoint (hf backend)",
             "trust_remote_code"),
    Variable("TOOL_CALL_PARSER", "from the chat template", "`hermes` or `llama3_json`: the "
             "syntax the model writes tool calls in", "tool_call_parser"),
    Variable("ENABLE_LORA", "`0`", "serve LoRA adapters", "enable_lora"),
    Variable("LORA_MODULES", "none", 'adapters served from the start: `[{"name": "a", '
             '"path": "/adapters/a"}]`', "lora_modules", _lora_modules),
    Variable("MAX_LORAS", "`4`", "LoRA adapters resident at once", "max_loras"),
    Variable("MAX_LORA_RANK", "`16`", "largest LoRA rank served", "max_lora_rank"),
    Variable("MAX_CONCURRENCY", "the worker's batch capacity (`MAX_NUM_SEQS` on the native "
             "engine, 5 on hf)", "jobs RunPod gives this worker at once (the SDK's concurrency "
             "modifier); more wait in the worker's queue"),
    Variable("DEFAULT_BATCH_SIZE", f"`{DEFAULT_BATCH_SIZE}`", "streamed chunks per yield at most"),
    Variable("DEFAULT_MIN_BATCH_SIZE", f"`{DEFAULT_MIN_BATCH_SIZE}`",
             "streamed chunks in the first yield"),
    Variable("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", f"`{DEFAULT_BATCH_SIZE_GROWTH_FACTOR:g}`",
             "each yield holds this many times the previous one's chunks, up to "
             "`DEFAULT_BATCH_SIZE`"),
    Variable("RAW_OPENAI_OUTPUT", "`1`", "`openai_route` streams: `1` yields the SSE text "
             "(`data: {...}\\n\\n` events, `data: [DONE]` included) as one string per batch; "
             "`0` yields each batch as a list of the chunk objects, without `[DONE]`"),
    Variable("REQUEST_TIMEOUT", f"`{DEFAULT_REQUEST_TIMEOUT_S:g}`",
             "seconds a job may wait on the gateway's answer"),
    # Ours.
    Variable("BACKEND", "`auto`", "`paged` (the native engine), `hf` (plain transformers) or "
             "`auto` (`paged` for the architectures it runs)", "backend"),
    Variable("DEVICE", "`auto`", "`cpu` or `cuda`", "device"),
    Variable("KV_CACHE_MEMORY", "`2GiB`", "the native engine's KV pool on CPU",
             "kv_cache_memory"),
    Variable("STARTUP_TIMEOUT", f"`{DEFAULT_STARTUP_TIMEOUT_S:g}`", "seconds each internal "
             "service may take to answer `/health` (the first start converts the default model)"),
    Variable("GATEWAY_PORT", "`0` (a free one)", "loopback port of the internal OpenAI gateway"),
)


@dataclass(frozen=True)
class HandlerConfig:
    """What the job handler needs: batching, output format, limits."""

    max_concurrency: int | None = None
    """None: the worker's own capacity, read once the stack is up."""
    default_batch_size: int = DEFAULT_BATCH_SIZE
    min_batch_size: int = DEFAULT_MIN_BATCH_SIZE
    batch_size_growth_factor: float = DEFAULT_BATCH_SIZE_GROWTH_FACTOR
    raw_openai_output: bool = True
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S


@dataclass(frozen=True)
class ServerlessConfig:
    worker_args: tuple[str, ...]
    """The model worker's flags."""
    handler: HandlerConfig
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    gateway_port: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ServerlessConfig:
        """The configuration `environ` describes; ConfigError naming the first bad variable."""
        def text(name: str) -> str | None:
            value = environ.get(name, "").strip()
            return value or None

        def number(name: str, kind: type, default, *, minimum: float, above: bool = False):
            raw = text(name)
            if raw is None:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ConfigError(f"${name}={raw!r}: expected a{'n integer' if kind is int else ' number'}") from None
            if value < minimum or (above and value == minimum):
                raise ConfigError(f"${name}={raw!r}: must be {'above' if above else 'at least'} {minimum:g}")
            return value

        raw_output = text("RAW_OPENAI_OUTPUT")
        handler = HandlerConfig(
            max_concurrency=number("MAX_CONCURRENCY", int, None, minimum=1),
            default_batch_size=number("DEFAULT_BATCH_SIZE", int, DEFAULT_BATCH_SIZE, minimum=1),
            min_batch_size=number("DEFAULT_MIN_BATCH_SIZE", int, DEFAULT_MIN_BATCH_SIZE, minimum=1),
            batch_size_growth_factor=number("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", float,
                                            DEFAULT_BATCH_SIZE_GROWTH_FACTOR, minimum=0, above=True),
            raw_openai_output=True if raw_output is None else parse_bool("RAW_OPENAI_OUTPUT", raw_output),
            request_timeout_s=number("REQUEST_TIMEOUT", float, DEFAULT_REQUEST_TIMEOUT_S,
                                     minimum=0, above=True))
        return cls(worker_args=tuple(worker_args(environ)), handler=handler,
                   startup_timeout_s=number("STARTUP_TIMEOUT", float, DEFAULT_STARTUP_TIMEOUT_S,
                                            minimum=0, above=True),
                   gateway_port=number("GATEWAY_PORT", int, 0, minimum=0))


def worker_args(environ: Mapping[str, str]) -> list[str]:
    """The model worker's flags from the variables that name one of its settings, each checked by
    the worker's settings model; the served name defaults to MODEL_NAME, as worker-vllm's does."""
    model = service_settings_models()["llmplatform.model_worker"]
    values = {v.name: environ[v.name].strip() for v in VARIABLES
              if v.worker_setting is not None and environ.get(v.name, "").strip()}
    if "MODEL_NAME" in values and "OPENAI_SERVED_MODEL_NAME_OVERRIDE" not in values:
        values["OPENAI_SERVED_MODEL_NAME_OVERRIDE"] = values["MODEL_NAME"]
    argv: list[str] = []
    for variable in VARIABLES:  # in the table's order
        name, raw = variable.name, values.get(variable.name)
        if raw is None:
            continue
        value: object = raw
        if variable.convert is not None:
            value = variable.convert(raw)
        try:
            argv += argv_for(model, {variable.worker_setting: value}, source=f"${name}")
        except SettingsError as exc:
            raise ConfigError(str(exc)) from None
    return argv
