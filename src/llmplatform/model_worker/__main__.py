"""``python -m llmplatform.model_worker``: serve one model over FastChat's worker protocol.

Its settings (every flag, `LLMPLATFORM_*` variable and `[[worker]]` key) are declared once in
``settings.py``. Exits with status 1 when its backend fails for good (its engine could not be
rebuilt, or failed more often than ``RestartConfig`` allows), so that a supervisor starts a fresh
process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from llmplatform.model_worker.backends import build_llm
from llmplatform.model_worker.settings import WorkerServiceSettings
from llmplatform.utils.logs import configure_logging, log_summary

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


def main(argv: Sequence[str] | None = None) -> None:
    settings = WorkerServiceSettings.parse(argv)
    configure_logging(settings.log_level, settings.log_format)
    from llmplatform.model_worker.app import WorkerSettings, create_app, drain

    try:
        llm = build_llm(settings.backend_config)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    worker = settings.section(
        WorkerSettings, worker_address=settings.announced_address,
        register=not settings.no_register,
        limit_worker_concurrency=settings.limit_worker_concurrency or llm.default_concurrency,
        retry_after=settings.overload_retry_after, guard=settings.worker_guard,
        prepare_grammars=True)
    app = create_app(llm, worker, on_backend_failure=_exit_after_backend_failure)
    from llmplatform.utils.startup import listen_url, worker_summary

    log_summary(logging.getLogger("llmplatform.worker"), "llmplatform worker",
                worker_summary(llm, worker, listen_url(settings.host, settings.port)))
    settings.run(app, on_drain=lambda: drain(app))


if __name__ == "__main__":
    main()
