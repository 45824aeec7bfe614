"""``python -m llmplatform.model_worker``: serve one model over FastChat's worker protocol.

Exits with status 1 when its backend fails for good (its engine could not be rebuilt, or failed
more often than ``RestartConfig`` allows), so that a supervisor starts a fresh process.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from urllib.parse import urlparse

from llmplatform.engine.config import COMPUTE_DTYPES
from llmplatform.model_worker.backends import BACKENDS, BackendConfig, build_llm
from llmplatform.utils.cli import apply_env_defaults
from llmplatform.utils.cluster_secret import SECRET_ENV, SECRET_HEADER, secret_from_env
from llmplatform.utils.logs import add_logging_flags, configure_logging, log_summary
from llmplatform.utils.request_guard import add_request_guard_flags, guard_config_from_args
from llmplatform.utils.server import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    add_connection_flags,
    connection_limits_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmplatform worker",
                                     description="Serve one model as a FastChat-compatible model worker.")
    parser.add_argument("--model-path", default=None,
                        help="local HF directory, hub id, or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--model-names", default=None,
                        help="comma-separated names to serve the model under (default: its directory name)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="inference backend (auto picks the best available)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=21002)
    parser.add_argument("--worker-address", default=None,
                        help="URL the controller and gateway reach this worker at "
                             "(default: http://HOST:PORT; required when binding 0.0.0.0)")
    parser.add_argument("--controller-address", default="http://127.0.0.1:21001")
    parser.add_argument("--no-register", action="store_true",
                        help="do not register with a controller")
    parser.add_argument("--limit-worker-concurrency", type=int, default=None,
                        help="requests let through to the backend at once; more wait in the "
                             "worker's queue (default: 5 for hf, 1024 for paged, which batches)")
    parser.add_argument("--heartbeat-interval", type=float, default=3.0,
                        help="seconds between heartbeats to the controller")
    parser.add_argument("--max-queue-len", type=int, default=512,
                        help="requests that may wait (for a concurrency slot or in the engine's "
                             "queue) before new ones are refused at once with HTTP 429 and "
                             "Retry-After (default: %(default)s)")
    parser.add_argument("--overload-retry-after", type=int, default=1, metavar="SECONDS",
                        help="the Retry-After a refused (429) request is given (default: %(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        metavar="SECONDS",
                        help="on SIGTERM: deregister at once, then let in-flight requests run this "
                             "long before cancelling them (default: %(default)s)")
    parser.add_argument("--cluster-secret", default=None,
                        help=f"the cluster's shared secret: sent to the controller, and required "
                             f"({SECRET_HEADER}) on every route but /health and /metrics; default: "
                             f"${SECRET_ENV} (prefer it: flags show in ps)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run Python code shipped with the checkpoint (transformers' "
                             "trust_remote_code; hf backend). Off by default: only for models "
                             "whose code you have read")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                        help="weights and activations dtype (auto: bfloat16)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="cap on prompt + output tokens (default: the model's context length)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template replacing the model's own (e.g. one that "
                             "handles tools); default: the model's own, or for SmolLM2-Instruct "
                             "(the default model) the shipped ChatML template with Hermes tools")
    parser.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"),
                        help="the syntax the model writes tool calls in (read from its output; "
                             "forced for tool_choice required/named). Default: read from the "
                             "chat template (<tool_call>: hermes); without one the model serves "
                             "no tools")
    engine = parser.add_argument_group("native engine (--backend paged)")
    engine.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="auto",
                        help="dtype of the matrix products. auto: the model dtype, except bf16/fp16 "
                             "on a CPU without bf16/fp16 matrix instructions (no AMX or "
                             "AVX512-BF16), where float32 is several times faster (projection "
                             "weights are then held in float32: twice the bf16 memory); model: "
                             "always the model dtype; float32: always float32")
    engine.add_argument("--max-num-seqs", type=int, default=64,
                        help="sequences batched together at most")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens computed per engine step (prefill chunks + decodes)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument("--kv-cache-memory", default="2GiB",
                        help="KV-cache size on CPU, e.g. 2GiB or 512MiB")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of GPU memory for weights, activations and KV cache (CUDA)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="reuse the KV cache of prompt prefixes seen before (default: on; "
                             "--no-enable-prefix-caching turns it off)")
    add_request_guard_flags(parser)
    add_connection_flags(parser)
    add_logging_flags(parser)
    return apply_env_defaults(parser)  # every flag also from LLMPLATFORM_<FLAG>


def worker_address_from(args: argparse.Namespace) -> str:
    """The announced address; a bind-all address is never announced."""
    if args.worker_address:
        address = args.worker_address.rstrip("/")
        host = urlparse(address).hostname or ""
    else:
        host = args.host
        address = f"http://{_bracket(host)}:{args.port}"
    if _is_unspecified(host):
        raise SystemExit(f"error: {address} is a bind address, not one others can reach; "
                         "pass --worker-address http://<reachable-host>:<port>")
    return address


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


BACKEND_FAILURE_EXIT_STATUS = 1


def _exit_after_backend_failure(reason: str) -> None:
    logging.getLogger("llmplatform.worker").critical(
        "exiting with status %d: the backend cannot serve any more (%s); a supervisor should "
        "start this worker again", BACKEND_FAILURE_EXIT_STATUS, reason)
    logging.shutdown()  # flush every handler: os._exit skips that
    # os._exit, not sys.exit: a normal interpreter exit joins the executor threads first, and a
    # step thread stuck in a broken device call would keep it waiting forever. Nothing is left
    # to save: the worker already left its controller and its requests have their errors.
    os._exit(BACKEND_FAILURE_EXIT_STATUS)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.limit_worker_concurrency is not None and args.limit_worker_concurrency < 1:
        raise SystemExit("error: --limit-worker-concurrency must be at least 1")
    if args.max_queue_len < 0:
        raise SystemExit("error: --max-queue-len must be at least 0")
    if args.overload_retry_after < 0:
        raise SystemExit("error: --overload-retry-after must be at least 0")
    if not args.shutdown_timeout > 0:
        raise SystemExit("error: --shutdown-timeout must be > 0")
    address = worker_address_from(args)
    try:
        guard = guard_config_from_args(args, own_names=[urlparse(address).hostname])
        limits = connection_limits_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    from llmplatform.model_worker.app import WorkerSettings, create_app, drain
    from llmplatform.utils.server import run_server

    names = tuple(n.strip() for n in args.model_names.split(",") if n.strip()) if args.model_names else None
    try:
        llm = build_llm(BackendConfig(model_path=args.model_path, model_names=names,
                                      backend=args.backend, device=args.device, dtype=args.dtype,
                                      compute_dtype=args.compute_dtype,
                                      max_concurrency=args.limit_worker_concurrency,
                                      max_model_len=args.max_model_len,
                                      max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      block_size=args.block_size,
                                      kv_cache_memory=args.kv_cache_memory,
                                      gpu_memory_utilization=args.gpu_memory_utilization,
                                      enable_prefix_caching=args.enable_prefix_caching,
                                      trust_remote_code=args.trust_remote_code,
                                      chat_template=args.chat_template,
                                      tool_call_parser=args.tool_call_parser))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    settings = WorkerSettings(worker_address=address, controller_address=args.controller_address,
                              register=not args.no_register,
                              limit_worker_concurrency=(args.limit_worker_concurrency
                                                        or llm.default_concurrency),
                              heartbeat_interval=args.heartbeat_interval,
                              max_queue_len=args.max_queue_len,
                              retry_after=args.overload_retry_after,
                              cluster_secret=secret_from_env(args.cluster_secret),
                              guard=guard, prepare_grammars=True)
    app = create_app(llm, settings, on_backend_failure=_exit_after_backend_failure)
    from llmplatform.utils.startup import listen_url, worker_summary

    log_summary(logging.getLogger("llmplatform.worker"), "llmplatform worker",
                worker_summary(llm, settings, listen_url(args.host, args.port)))
    run_server(app, host=args.host, port=args.port, log_level=args.log_level,
               shutdown_timeout=args.shutdown_timeout, on_drain=lambda: drain(app), limits=limits)


if __name__ == "__main__":
    main()
