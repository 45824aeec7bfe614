"""`python -m llmplatform.webui`: parse flags, build the app, run uvicorn.

`build_parser()` and `main(argv)` are public so `llmplatform webui ...` can reuse them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from llmplatform.utils.cli import apply_env_defaults
from llmplatform.utils.logs import add_logging_flags
from llmplatform.webui.settings import DEFAULT_PORT, WebUISettings

SHUTDOWN_GRACE_S = 3.0
"""On SIGTERM, how long open page connections may delay exit (the UI holds no work to drain)."""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m llmplatform.webui",
        description="The chat web UI (Chat, Arena and Cluster tabs), a client of the gateway.")
    parser.add_argument("--api-base", default="http://127.0.0.1:8000/v1",
                        help="the gateway's OpenAI base URL; a URL without a path gets /v1 "
                             "(default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="API key for the gateway, when it needs one (prefer the environment "
                             "variable to the flag: a flag shows in `ps`)")
    parser.add_argument("--controller-address", default="http://127.0.0.1:21001",
                        help="controller the Cluster tab reads the workers from; 'none' turns "
                             "the view off (default: %(default)s)")
    parser.add_argument("--cluster-secret", default=None,
                        help="the cluster's shared secret, for the Cluster tab's controller call "
                             "(default: $LLMPLATFORM_CLUSTER_SECRET, else none)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address; anything but loopback exposes the UI, and through "
                             "it the gateway, to the network (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="(default: %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=Path("logs"),
                        help="arena votes are appended to LOG_DIR/votes.jsonl "
                             "(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="starting value of the max-new-tokens slider (default: %(default)s)")
    parser.add_argument("--concurrency-limit", type=int, default=64,
                        help="generations run at once over all browser sessions; more wait in "
                             "Gradio's queue (default: %(default)s)")
    parser.add_argument("--cluster-refresh", type=float, default=3.0,
                        help="seconds between refreshes of the Cluster tab (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds the gateway may stay silent during an answer before the "
                             "chat shows a timeout (default: %(default)s)")
    add_logging_flags(parser)
    return apply_env_defaults(parser)  # every flag also from LLMPLATFORM_<FLAG>


def settings_from_args(args: argparse.Namespace) -> WebUISettings:
    from llmplatform.utils.cluster_secret import secret_from_env

    controller = args.controller_address
    return WebUISettings(
        api_base=args.api_base,
        api_key=args.api_key or None,
        controller_address=None if controller.strip().lower() == "none" else controller,
        cluster_secret=secret_from_env(args.cluster_secret),
        log_dir=args.log_dir,
        default_max_tokens=args.max_tokens,
        max_tokens_limit=max(4096, args.max_tokens),
        concurrency_limit=args.concurrency_limit,
        cluster_refresh_s=args.cluster_refresh,
        request_timeout=args.request_timeout,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    import uvicorn

    from llmplatform.utils.logs import configure_logging, uvicorn_log_options
    from llmplatform.webui.app import create_app  # imports Gradio: seconds, so only now

    configure_logging(args.log_level, args.log_format)
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                **uvicorn_log_options(args.log_level))


if __name__ == "__main__":
    main()
