"""``python -m llmplatform.model_worker``: serve one model over FastChat's worker protocol.

Its settings (every flag, `LLMPLATFORM_*` variable and `[[worker]]` key) are declared once in
``settings.py``. Exits with status 1 when its backend fails for good (its engine could not be
rebuilt, or failed more often than ``RestartConfig`` allows), so that a supervisor starts a fresh
process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.model_worker.settings import WorkerServiceSettings
from llmplatform.utils.logs import configure_logging, log_summary
from llmplatform.utils.startup import listen_url

if TYPE_CHECKING:
    from llmplatform.llm.base import LLMBackend
    from llmplatform.model_worker.app import WorkerSettings

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


def main(argv: Sequence[str] | None = None, *,
         build: Callable[[BackendConfig], LLMBackend] = build_backend) -> None:
    """``build``: turns the backend settings into the backend (the fault tests' worker passes
    `build_backend` with a fault-injecting ``runner_factory``)."""
    settings = WorkerServiceSettings.parse(argv)
    configure_logging(settings.log_level, settings.log_format)
    from llmplatform.model_worker.app import WorkerSettings, create_app, drain

    try:
        llm = build(settings.backend_config)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    worker = settings.section(
        WorkerSettings, worker_address=settings.announced_address,
        register=not settings.no_register,
        limit_worker_concurrency=settings.limit_worker_concurrency or llm.default_concurrency,
        retry_after=settings.overload_retry_after, guard=settings.worker_guard,
        prepare_grammars=True)
    app = create_app(llm, worker, on_backend_failure=_exit_after_backend_failure)
    log_summary(logging.getLogger("llmplatform.worker"), "llmplatform worker",
                worker_summary(llm, worker, listen_url(settings.host, settings.port)))
    settings.run(app, on_drain=lambda: drain(app))


def worker_summary(llm: LLMBackend, settings: WorkerSettings, listen: str) -> dict[str, Any]:
    info = llm.backend_info()
    tasks = [str(task) for task in llm.facts.tasks]
    if info.num_kv_blocks is not None and info.kv_block_size is not None:
        kv = (f"{info.num_kv_blocks} blocks x {info.kv_block_size} tokens = "
              f"{info.kv_capacity_tokens} tokens")
    elif "generate" not in tasks:
        # An encoder: one forward pass per batch, nothing kept.
        kv = f"none ({'embeddings' if 'embed' in tasks else 'scores'} only)"
    else:
        kv = "per request (no shared pool)"
    registered = settings.register and settings.controller_address
    return {
        "model": ",".join(llm.model_names),
        "backend": info.backend,
        "serves": ",".join(tasks),
        "dtype": info.dtype,
        "device": info.device,
        **({"attention": info.attention} if info.attention else {}),
        **({"weights": info.weights} if info.weights else {}),
        "kv_cache": kv,
        **({"tensor_parallel": f"{info.tensor_parallel_size} ranks, {info.num_kv_heads_per_rank} "
                               f"KV head(s) and {info.num_kv_blocks} KV blocks per rank"}
           if info.tensor_parallel_size > 1 else {}),
        "max_model_len": llm.context_length,
        "concurrency": settings.limit_worker_concurrency,
        "listen": listen,
        "address": settings.worker_address or listen,
        "controller": settings.controller_address if registered else "none (not registering)",
        "metrics": f"{listen}/metrics",
    }


if __name__ == "__main__":
    main()
