"""The model worker's settings: every flag of `llmplatform worker`, declared once.

`WorkerServiceSettings` is the single source of each flag's name, type, help, variable
(`LLMPLATFORM_<FLAG>`) and cluster-file key (`[[worker]]` tables; `utils/settings.py`). A backend
setting's default is `BackendConfig`'s (`llm/build.py`, which the offline ``LLM`` reads too), so a
flag, its `[[worker]]` key and its keyword argument cannot disagree. It holds no torch:
`llmplatform serve` reads it to turn a cluster file into workers' flags.
"""

from __future__ import annotations

import ipaddress
from functools import cached_property
from typing import Literal
from urllib.parse import urlparse

from llmplatform.llm.build import (
    ASYNC_OUTPUT_MODES,
    BACKENDS,
    BLOCKED_LINEAR_CHOICES,
    COMPUTE_DTYPES,
    DECODE_PATHS,
    NORMALIZE_CHOICES,
    POOLING_CHOICES,
    QUANTIZATIONS,
    TASKS,
    BackendConfig,
)
from llmplatform.protocol.reasoning import REASONING_PARSERS
from llmplatform.protocol.tool_calls import TOOL_CALL_SYNTAXES
from llmplatform.utils.cluster_secret import SECRET_HEADER
from llmplatform.utils.request_guard import RequestGuardConfig
from llmplatform.utils.server import DEFAULT_SHUTDOWN_TIMEOUT_S
from llmplatform.utils.service_settings import ServerSettings
from llmplatform.utils.settings import CommaList, OptionalText, option

Backend = Literal[BACKENDS]  # type: ignore[valid-type]
Task = Literal[TASKS]  # type: ignore[valid-type]
Pooling = Literal[POOLING_CHOICES]  # type: ignore[valid-type]
Normalize = Literal[NORMALIZE_CHOICES]  # type: ignore[valid-type]
ComputeDtype = Literal[COMPUTE_DTYPES]  # type: ignore[valid-type]
DecodePath = Literal[DECODE_PATHS]  # type: ignore[valid-type]
BlockedLinear = Literal[BLOCKED_LINEAR_CHOICES]  # type: ignore[valid-type]
AsyncOutput = Literal[ASYNC_OUTPUT_MODES]  # type: ignore[valid-type]
Quantization = Literal[QUANTIZATIONS]  # type: ignore[valid-type]
ToolCallSyntax = Literal[TOOL_CALL_SYNTAXES]  # type: ignore[valid-type]
ReasoningParser = Literal[REASONING_PARSERS]  # type: ignore[valid-type]
_DEFAULT = BackendConfig()
_ENGINE = "native engine (--backend paged)"
_EMBED = "embedding models (--task embed; --backend encoder or paged)"


class WorkerServiceSettings(ServerSettings):
    cli_prog = "llmplatform worker"
    cli_description = "Serve one model as a FastChat-compatible model worker."
    sections = ("worker_guard", "backend_config")

    model_path: str | None = option(
        _DEFAULT.model_path, "local HF directory, hub id, or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct)")
    model_names: CommaList = option((), "comma-separated names to serve the model under "
                                    "(default: its directory name)")
    backend: Backend = option(
        _DEFAULT.backend, "inference backend (auto picks the best available; an embedding model "
        "folder gets encoder)")
    task: Task = option(
        _DEFAULT.task, "what the worker serves: generate (chat, completions), embed "
        "(embeddings) or score (rerank and score: a cross-encoder). auto: score for a BERT-family "
        "sequence classifier, embed for an embedding model folder (sentence-transformers files, "
        "or a BERT-family encoder), else generate. A Llama/Mistral/Qwen2 decoder with embed runs the "
        "native engine's pooling mode (see --pooling)")
    port: int = option(21002, "bind port; 0 picks a free one (default: %(default)s)")
    worker_address: str | None = option(
        None, "URL the controller and gateway reach this worker at (default: http://HOST:PORT; "
        "required when binding 0.0.0.0)")
    controller_address: str = option("http://127.0.0.1:21001",
                                     "the controller's URL (default: %(default)s)")
    no_register: bool = option(False, "do not register with a controller")
    limit_worker_concurrency: int | None = option(
        None, "requests let through to the backend at once; more wait in the worker's queue "
        "(default: 5 for hf, 1024 for paged, which batches)", ge=1)
    heartbeat_interval: float = option(3.0, "seconds between heartbeats to the controller", gt=0)
    max_queue_len: int = option(
        512, "requests that may wait (for a concurrency slot or in the engine's queue) before "
        "new ones are refused at once with HTTP 429 and Retry-After (default: %(default)s)", ge=0)
    overload_retry_after: int = option(
        1, "the Retry-After a refused (429) request is given (default: %(default)s)",
        metavar="SECONDS", ge=0)
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S, "on SIGTERM: deregister at once, then let in-flight requests "
        "run this long before cancelling them (default: %(default)s)", metavar="SECONDS", gt=0)
    cluster_secret: OptionalText = option(
        None, f"the cluster's shared secret: sent to the controller, and required "
        f"({SECRET_HEADER}) on every route but /health and /metrics; default: "
        "$LLMPLATFORM_CLUSTER_SECRET (prefer it: flags show in ps)", secret=True)
    trust_remote_code: bool = option(
        _DEFAULT.trust_remote_code, "run Python code shipped with the checkpoint (transformers' "
        "trust_remote_code; hf backend). Off by default: only for models whose code you have read")
    device: Literal["auto", "cpu", "cuda"] = option(_DEFAULT.device, "(default: %(default)s)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        _DEFAULT.dtype, "weights and activations dtype (auto: bfloat16)")
    max_model_len: int | None = option(
        _DEFAULT.max_model_len, "cap on prompt + output tokens (default: the model's context "
        "length)", ge=1)
    chat_template: str | None = option(
        _DEFAULT.chat_template, "a Jinja chat template replacing the model's own (e.g. one that "
        "handles tools); default: the model's own, or for SmolLM2-Instruct (the default model) the "
        "shipped ChatML template with Hermes tools", metavar='FILE')
    tool_call_parser: ToolCallSyntax | None = option(
        _DEFAULT.tool_call_parser, "the syntax the model writes tool calls in (read from its "
        "output; forced for tool_choice required/named). Default: read from the chat template "
        "(<tool_call>: hermes); without one the model serves no tools")
    reasoning_parser: ReasoningParser | None = option(
        _DEFAULT.reasoning_parser, "the model thinks in <think>...</think> before answering: "
        "the gateway returns the thoughts as reasoning_content, apart from the answer, and "
        "applies structured outputs and tool calls to the answer only (deepseek_r1: the output "
        "may start inside the thoughts; qwen3: likewise, and enable_thinking false in "
        "chat_template_kwargs means no thoughts). Default: none (the output is all answer)")
    compute_dtype: ComputeDtype = option(
        _DEFAULT.compute_dtype, "dtype of the matrix products. auto: the model dtype, except "
        "bf16/fp16 on a CPU without bf16/fp16 matrix instructions (no AMX or AVX512-BF16), where "
        "float32 is several times faster (projection weights are then held in float32: twice the "
        "bf16 memory); model: always the model dtype; float32: always float32", group=_ENGINE)
    decode_path: DecodePath = option(
        _DEFAULT.decode_path, "how steps of up to 16 rows (decode batches) run. fused: projections "
        "on a C kernel that streams the weights as loaded (bf16: half the bytes of the float32 "
        "copy), one C call per RMSNorm, two for rotary + KV store + decode attention; eager: torch "
        "ops only (the reference, for debugging); auto: fused on CPU when its kernels build, else "
        "eager (logged)", group=_ENGINE)
    blocked_linear: BlockedLinear = option(
        _DEFAULT.blocked_linear, "how steps of 17-64 rows (batched decode) multiply. auto: on a "
        "register-blocked AVX2 kernel over the bf16 weights as loaded (float32 sums) when the fused "
        "path runs a bf16 model on an AVX2 CPU without AVX-512 or bf16 matrix instructions, else as "
        "larger steps do "
        "(oneDNN; logged); on: always that kernel (CPU; an error where it cannot run); off: never",
        group=_ENGINE)
    quantization: Quantization = option(
        _DEFAULT.quantization, "gguf: a GGUF model's projection weights (q/k/v, o, gate/up, down) "
        "stay in their Q8_0/Q4_1 blocks and decode steps read those (2-3x fewer bytes than bf16) "
        "instead of the dequantized copy; needs a .gguf --model-path or the default model, CPU "
        "only. none: dequantize at load (default: %(default)s)", group=_ENGINE)
    enforce_eager: bool = option(
        _DEFAULT.enforce_eager, "CUDA: run every step eagerly, kernel by kernel from Python. "
        "Without it, decode steps of up to min(--max-num-seqs, 256) rows replay CUDA graphs "
        "captured at start, one per batch size 1, 2, 4, 8, 16, 24, ... (the startup log lists "
        "them; their memory is left out of the KV pool). Never used on CPU or with tensor or "
        "pipeline parallelism", group=_ENGINE)
    tensor_parallel_size: int = option(
        _DEFAULT.tensor_parallel_size, "split the model over this many ranks (tensor parallelism: "
        "each holds 1/N of the attention heads, KV heads, MLP and vocabulary, and the KV cache of "
        "its heads; rank 0 is this process, the others are processes it starts on this host; NCCL "
        "on CUDA, gloo on CPU). The model's attention and KV head counts must divide by it "
        "(default: %(default)s)", group=_ENGINE, ge=1)
    tensor_parallel_timeout: float = option(
        _DEFAULT.tensor_parallel_timeout, "with --tensor-parallel-size > 1: how long a step waits "
        "on the other ranks before it fails (a rank that hangs; one that dies is noticed at once). "
        "The engine then starts the ranks again, or the worker exits for its supervisor (default: "
        "%(default)s)", metavar='SECONDS', group=_ENGINE, gt=0)
    pipeline_parallel_size: int = option(
        _DEFAULT.pipeline_parallel_size, "split the model's decoder layers into this many stages "
        "(pipeline parallelism: each stage an equal, contiguous range of layers and their KV cache "
        "on --tensor-parallel-size ranks of its own, so P x T ranks in all; hidden states pass stage "
        "to stage point to point). As many virtual engines, each with its own scheduler and share "
        "of the KV cache, keep the stages busy at once. The layer count must divide by it "
        "(default: %(default)s)", group=_ENGINE, ge=1)
    max_num_seqs: int = option(
        _DEFAULT.max_num_seqs, "sequences batched together at most", group=_ENGINE, ge=1)
    max_num_batched_tokens: int = option(
        _DEFAULT.max_num_batched_tokens, "tokens computed per engine step (prefill chunks + "
        "decodes)", group=_ENGINE, ge=1)
    background_slowdown: float = option(
        _DEFAULT.background_slowdown, "while interactive requests run, how much longer background "
        "requests (the gateway's batch lines, priority >= 2^30) may make an engine step, as a "
        "fraction of its duration without them: measured step by step, so they take what the "
        "hardware leaves idle; 0: none while interactive ones run (default: %(default)s)",
        group=_ENGINE, ge=0)
    background_max_step_tokens: int = option(
        _DEFAULT.background_max_step_tokens, "the most tokens a step gives background requests "
        "when no interactive one is unfinished: what an arriving interactive request may wait "
        "behind (default: %(default)s)", group=_ENGINE, ge=1)
    background_grace_s: float = option(
        _DEFAULT.background_grace_s, "for this many seconds after interactive work, background "
        "requests keep the share they get beside it, so the next interactive request does not "
        "wait behind a big step (default: %(default)s)", metavar="SECONDS", group=_ENGINE, ge=0)
    block_size: int = option(_DEFAULT.block_size, "tokens per KV-cache block", group=_ENGINE, ge=1)
    kv_cache_memory: str = option(
        _DEFAULT.kv_cache_memory, "KV-cache size on CPU, e.g. 2GiB or 512MiB", group=_ENGINE)
    gpu_memory_utilization: float = option(
        _DEFAULT.gpu_memory_utilization, "fraction of GPU memory for weights, activations and KV "
        "cache (CUDA)", group=_ENGINE)
    embed_max_batch_tokens: int | None = option(
        _DEFAULT.embed_max_batch_tokens, "embedding models: tokens per forward pass at most "
        "(padded: inputs x longest; a BERT encoder's packed batches count their tokens); "
        "concurrent requests' inputs are batched together up to it (default: 1024 on CPU, where "
        "larger batches run slower, 16384 on GPU)", group=_EMBED, ge=1)
    embed_batch_wait_ms: float = option(
        _DEFAULT.embed_batch_wait_ms, "embedding models: how long a first queued input waits for "
        "others to batch with (default: %(default)s)", group=_EMBED, ge=0, le=1000)
    pooling: Pooling = option(
        _DEFAULT.pooling, "decoder embedding models (--task embed on the paged backend): the "
        "vector is the last token's final hidden state (last: e5-mistral, gte-Qwen2) or the mean "
        "over the input (mean). auto: the folder's 1_Pooling/config.json, else last", group=_EMBED)
    embed_normalize: Normalize = option(
        _DEFAULT.embed_normalize, "decoder embedding models: L2-normalize the vectors (yes/no). "
        "auto: as the folder's modules.json says (a Normalize module), else yes", group=_EMBED)
    grammar_token_budget_ms: float = option(
        _DEFAULT.grammar_token_budget_ms, "structured outputs: the longest one output token's "
        "grammar mask may take. A new grammar slower than this on its first tokens is refused "
        "(400); a request whose mask takes longer later is failed alone (400) and its grammar "
        "process killed, so it holds other requests' step at most this long, once (default: "
        "%(default)s)", metavar='MS', gt=0)
    grammar_cache_memory: str = option(
        _DEFAULT.grammar_cache_memory, "structured outputs: memory for compiled grammars kept for "
        "reuse (LRU); one grammar may use at most min(16MiB, this) or is refused (default: "
        "%(default)s)")
    grammar_compile_timeout: float = option(
        _DEFAULT.grammar_compile_timeout, "structured outputs: a grammar that takes longer to "
        "compile is refused (400) and its compile process killed (default: %(default)s)",
        metavar='SECONDS', gt=0)
    enable_lora: bool = option(
        _DEFAULT.enable_lora, "serve LoRA adapters: loaded at runtime (the gateway's "
        "/v1/load_lora_adapter) and named in a request's model (implied by --lora-modules)",
        group=_ENGINE)
    lora_modules: tuple[str, ...] = option(
        _DEFAULT.lora_modules, "a PEFT LoRA adapter folder to serve from the start, as NAME=PATH "
        "(repeatable)", metavar="NAME=PATH", group=_ENGINE, repeatable=True)
    max_loras: int = option(
        _DEFAULT.max_loras, "LoRA adapters resident at once (slots); requests for more wait, the "
        "least recently used idle adapter is evicted (default: %(default)s)", group=_ENGINE, ge=1)
    max_lora_rank: int = option(
        _DEFAULT.max_lora_rank, "the largest LoRA rank served; a larger adapter is refused "
        "(default: %(default)s)", group=_ENGINE, ge=1, le=512)
    speculative_config: OptionalText = option(
        _DEFAULT.speculative_config, "speculative decoding, as a JSON object like vLLM's: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}, or with a draft model of the same '
        'tokenizer: {"model": "PATH", "num_speculative_tokens": 4} (docs/engine.md; default: off)',
        metavar="JSON", group=_ENGINE)
    async_output_processing: AsyncOutput = option(
        _DEFAULT.async_output_processing, "detokenizing and stop strings on an output thread, "
        "overlapped with the next step instead of between steps (an output a stop string ends "
        "runs one step more, never emitted). auto: on with CUDA, off on CPU, where it measured "
        "no gain (docs/performance.md) (default: %(default)s)", group=_ENGINE)
    enable_prefix_caching: bool = option(
        _DEFAULT.enable_prefix_caching, "reuse the KV cache of prompt prefixes seen before "
        "(default: on; --no-enable-prefix-caching turns it off)", group=_ENGINE, negatable=True)

    @cached_property
    def announced_address(self) -> str:
        """The URL others reach this worker at; a bind-all address is never announced."""
        if self.worker_address:
            address = self.worker_address.rstrip("/")
            host = urlparse(address).hostname or ""
        else:
            host = self.host
            address = f"http://{_bracket(host)}:{self.port}"
        if _is_unspecified(host):
            raise ValueError(f"{address} is a bind address, not one others can reach; pass "
                             "--worker-address http://<reachable-host>:<port>")
        return address

    @cached_property
    def backend_config(self) -> BackendConfig:
        """What `build_backend` loads, and how."""
        return self.section(BackendConfig, model_names=self.model_names or None,
                            max_concurrency=self.limit_worker_concurrency)

    @cached_property
    def worker_guard(self) -> RequestGuardConfig:
        """The request guard; the announced address's host is always an allowed Host."""
        return self.guard_config(own_names=[urlparse(self.announced_address).hostname])


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
