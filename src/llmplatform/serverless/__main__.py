"""`python -m llmplatform.serverless`: a RunPod serverless worker (docs/serverless.md).

Configured by environment variables only (`config.py`); the command line belongs to the runpod
SDK (`--test_input JSON`, `--rp_serve_api --rp_api_port N --rp_api_host H`, ...), which reads it
itself. Starts the serving stack (`stack.py`), then hands the job handler (`handler.py`) to
`runpod.serverless.start`, and stops the stack when the SDK returns or exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from llmplatform.serverless.config import ConfigError, ServerlessConfig
from llmplatform.serverless.handler import JobHandler
from llmplatform.serverless.stack import Stack
from llmplatform.utils.logs import configure_logging

logger = logging.getLogger("llmplatform.serverless")


def runs_one_local_job(argv: list[str]) -> bool:
    """Whether the SDK will run one job locally (`--test_input`, or test_input.json when no
    RunPod job queue is configured) rather than serve: it then calls the handler once without
    iterating a generator, so it gets the handler's aggregating form. Decided as the SDK's
    `start` decides it (runpod 1.10-1.12), with the SDK's own argument parser."""
    from runpod.serverless import parser

    args, _ = parser.parse_known_args(argv)
    if args.rp_serve_api or int(os.environ.get("RUNPOD_REALTIME_PORT", "0") or 0):
        return False
    return bool(args.test_input) or os.environ.get("RUNPOD_WEBHOOK_GET_JOB") is None


def main(argv: list[str] | None = None) -> None:
    configure_logging(os.environ.get("LLMPLATFORM_LOG_LEVEL", "info"))
    try:
        import runpod
    except ImportError:
        raise SystemExit("llmplatform serverless: the runpod SDK is missing: "
                         "pip install 'llmplatform[serverless]'") from None
    try:
        config = ServerlessConfig.from_env(os.environ)
    except ConfigError as exc:
        raise SystemExit(f"llmplatform serverless: error: {exc}") from None
    one_job = runs_one_local_job(list(sys.argv[1:] if argv is None else argv))

    # Until the SDK installs its own handlers, SIGTERM unwinds through `finally`: no child is
    # left behind (they also get SIGTERM if this process dies: serve's parent-death signal).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    stack = Stack(config)
    try:
        try:
            worker = stack.start()
        except RuntimeError as exc:
            raise SystemExit(f"llmplatform serverless: error: {exc}") from None
        handler = JobHandler(stack.gateway_url, worker.model, config.handler,
                             capacity=worker.capacity)
        logger.info("serving %s through %s; concurrency %d", worker.model, stack.gateway_url,
                    handler.concurrency(1))
        runpod.serverless.start({
            "handler": handler.aggregate if one_job else handler.run,
            "concurrency_modifier": handler.concurrency,
            # /run + /status on RunPod answers a streamed job's yields as one list.
            "return_aggregate_stream": True,
        })
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
