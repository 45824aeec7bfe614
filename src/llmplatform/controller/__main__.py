"""`python -m llmplatform.controller`: parse flags, build the app, run uvicorn.

`build_parser()` and `main(argv)` are public so `llmplatform controller ...` can reuse them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from llmplatform.controller.app import ControllerConfig, create_app
from llmplatform.controller.dispatch import DispatchMethod
from llmplatform.controller.registry import DEFAULT_HEARTBEAT_EXPIRATION_S
from llmplatform.utils.logs import configure_logging

DEFAULT_PORT = 21001
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the controller's flags to `parser` (a new one if None) and return it."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m llmplatform.controller",
        description="Run the llmplatform controller (FastChat-compatible worker registry).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="bind port; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--dispatch-method",
        choices=[m.value for m in DispatchMethod],
        default=DispatchMethod.SHORTEST_QUEUE.value,
        help="how to choose among workers serving a model (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-expiration",
        type=float,
        default=DEFAULT_HEARTBEAT_EXPIRATION_S,
        metavar="SECONDS",
        help="drop a worker after this long without a heartbeat (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="(default: %(default)s)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = ControllerConfig(
            dispatch_method=DispatchMethod(args.dispatch_method),
            heartbeat_expiration=args.heartbeat_expiration,
        )
    except ValueError as exc:
        build_parser().error(str(exc))
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
