"""`python -m llmplatform.controller`: parse flags, build the app, serve it (graceful SIGTERM).

`build_parser()` and `main(argv)` are public so `llmplatform controller ...` can reuse them.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from llmplatform.controller.app import create_app
from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.dispatch import DEFAULT_DISPATCH_METHOD, DispatchMethod
from llmplatform.controller.registry import DEFAULT_HEARTBEAT_EXPIRATION_S
from llmplatform.utils.cli import apply_env_defaults
from llmplatform.utils.cluster_secret import SECRET_ENV, SECRET_HEADER, secret_from_env
from llmplatform.utils.logs import add_logging_flags, configure_logging, log_summary
from llmplatform.utils.startup import controller_summary, listen_url
from llmplatform.utils.request_guard import add_request_guard_flags, guard_config_from_args
from llmplatform.utils.server import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    add_connection_flags,
    connection_limits_from_args,
    run_server,
)

DEFAULT_PORT = 21001


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
        default=DEFAULT_DISPATCH_METHOD.value,
        help="how to choose among workers serving a model: least_load (share of batch capacity "
        "in use, avoiding full KV caches), shortest_queue (FastChat's queue_length/speed) or "
        "lottery (random, weighted by speed) (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-expiration",
        type=float,
        default=DEFAULT_HEARTBEAT_EXPIRATION_S,
        metavar="SECONDS",
        help="drop a worker after this long without a heartbeat (default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM: stop accepting, let in-flight requests (proxied streams) run this long, "
        "then exit (default: %(default)s)",
    )
    parser.add_argument(
        "--cluster-secret",
        default=None,
        help=f"shared secret every worker and gateway must send ({SECRET_HEADER}); default: "
        f"${SECRET_ENV} (prefer it: flags show in ps). Unset: no secret is required",
    )
    parser.add_argument(
        "--allowed-worker-networks",
        default="",
        metavar="CIDRS",
        help="comma-separated networks (e.g. 10.0.0.0/8,127.0.0.1/32) a worker's announced "
        "address must lie in, however it is spelled; host names must resolve into them "
        "(default: any address except bind-all, multicast, link-local, broadcast and cloud "
        "metadata endpoints)",
    )
    parser.add_argument(
        "--confirm-timeout",
        type=float,
        default=ControllerConfig.confirm_timeout,
        metavar="SECONDS",
        help="how long a registered worker that does not answer /worker_get_status yet is "
        "waited for (never routed meanwhile); stock FastChat workers register before they "
        "listen (default: %(default)s)",
    )
    add_request_guard_flags(parser)
    add_connection_flags(parser)
    add_logging_flags(parser)
    return apply_env_defaults(parser)  # every flag also from LLMPLATFORM_<FLAG>


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        config = ControllerConfig(
            dispatch_method=DispatchMethod(args.dispatch_method),
            heartbeat_expiration=args.heartbeat_expiration,
            cluster_secret=secret_from_env(args.cluster_secret),
            allowed_worker_networks=tuple(n for n in args.allowed_worker_networks.split(",") if n.strip()),
            confirm_timeout=args.confirm_timeout,
            guard=guard_config_from_args(args),
        )
        limits = connection_limits_from_args(args)
    except ValueError as exc:
        build_parser().error(str(exc))
    if not args.shutdown_timeout > 0:
        build_parser().error("--shutdown-timeout must be > 0 seconds")
    log_summary(logging.getLogger("llmplatform.controller"), "llmplatform controller",
                controller_summary(config, listen_url(args.host, args.port)))
    run_server(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout,
        limits=limits,
    )


if __name__ == "__main__":
    main()
