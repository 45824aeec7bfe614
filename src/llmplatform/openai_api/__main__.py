"""`python -m llmplatform.openai_api`: parse flags, build the app, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

from llmplatform.openai_api.app import create_app
from llmplatform.openai_api.settings import GatewaySettings, RequestLimits, RoutingMode
from llmplatform.utils.cli import apply_env_defaults
from llmplatform.utils.cluster_secret import SECRET_ENV, secret_from_env
from llmplatform.utils.logs import add_logging_flags, configure_logging, log_summary
from llmplatform.utils.request_guard import add_request_guard_flags, allowed_hosts_for
from llmplatform.utils.startup import gateway_summary, listen_url
from llmplatform.utils.server import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    add_connection_flags,
    connection_limits_from_args,
    run_server,
)

API_KEYS_ENV = "LLMPLATFORM_API_KEYS"
_LIMITS = RequestLimits()
_DEFAULTS = GatewaySettings()


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m llmplatform.openai_api", description="OpenAI-compatible API gateway."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--controller-address", default="http://127.0.0.1:21001")
    parser.add_argument(
        "--api-keys",
        type=_csv,
        default=None,
        help=f"Comma-separated keys; when set, every route but /health and /metrics needs "
        f"'Authorization: Bearer KEY'. Default: ${API_KEYS_ENV} (prefer it: flags show in ps).",
    )
    parser.add_argument(
        "--admin-api-keys",
        type=_csv,
        default=[],
        help="Comma-separated keys for /v1/admin (e.g. reset_prefix_cache); they also work for /v1. "
        "Without them, every --api-keys key is an admin key.",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_csv,
        default=[],
        help="Comma-separated CORS origins (default: none, CORS off; '*' allows any origin).",
    )
    parser.add_argument("--allowed-methods", type=_csv, default=["*"], help="CORS methods.")
    parser.add_argument("--allowed-headers", type=_csv, default=["*"], help="CORS headers.")
    parser.add_argument(
        "--allow-credentials", action="store_true", help="CORS credentials (refused with origin '*')."
    )
    parser.add_argument(
        "--cluster-secret",
        default=None,
        help=f"The cluster's shared secret, sent to the controller and workers. Default: ${SECRET_ENV} "
        "(prefer it: flags show in ps).",
    )
    limits = parser.add_argument_group("request limits (a request over one is a 400; the body cap a 413)")
    limits.add_argument(
        "--max-n", type=int, default=_LIMITS.max_n,
        help="most choices per request: n times the number of prompts (default: %(default)s)",
    )
    limits.add_argument(
        "--max-logprobs", type=int, default=_LIMITS.max_logprobs,
        help="most alternatives per token: top_logprobs (chat), logprobs (completions); at most 20 "
        "(default: %(default)s)",
    )
    limits.add_argument(
        "--max-stop-sequences", type=int, default=_LIMITS.max_stop_sequences,
        help="most stop strings per request (default: %(default)s, as OpenAI)",
    )
    limits.add_argument(
        "--max-stop-length", type=int, default=_LIMITS.max_stop_length,
        help="longest stop string, in characters (default: %(default)s)",
    )
    limits.add_argument(
        "--max-request-bytes", type=int, default=_LIMITS.max_request_bytes,
        help="largest request body in bytes; larger is refused with 413 unread (default: %(default)s)",
    )
    limits.add_argument(
        "--max-streams-per-key", type=int, default=0, metavar="N",
        help="streamed generations one caller may have open at once; one more gets 429. The "
        "caller is its API key; without --api-keys, its client address (behind a proxy: the "
        "proxy's, shared by all). 0: no cap (default: %(default)s)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=600.0,
        help="Seconds a worker may stay silent before the request fails with 504.",
    )
    parser.add_argument(
        "--max-worker-attempts",
        type=int,
        default=3,
        help="workers one request may be tried on: when a worker cannot take it before answering "
        "(unreachable, died, 503, 429), another serving the model is tried, up to this many in "
        "all (default: %(default)s)",
    )
    parser.add_argument(
        "--routing",
        choices=[mode.value for mode in RoutingMode],
        default=_DEFAULTS.routing.value,
        help="how a request's worker is chosen: 'local' from the gateway's own table of live "
        "workers (refreshed from the controller's /list_workers, ranked with the controller's "
        "dispatch method; no controller call per request), 'controller' by asking the "
        "controller's /get_worker_address for every request (default: %(default)s)",
    )
    parser.add_argument(
        "--worker-refresh-interval",
        type=float,
        default=_DEFAULTS.worker_refresh_interval,
        metavar="SECONDS",
        help="with --routing local: seconds between two reads of the controller's worker list "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM: stop accepting, let in-flight requests run this long, then exit "
        "(default: %(default)s)",
    )
    add_request_guard_flags(parser, body_cap=False)  # --allowed-hosts (--max-request-bytes is above)
    add_connection_flags(parser)
    add_logging_flags(parser)
    return apply_env_defaults(parser)  # every flag also from LLMPLATFORM_<FLAG>


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    api_keys = args.api_keys if args.api_keys is not None else _csv(os.environ.get(API_KEYS_ENV, ""))
    return GatewaySettings(
        controller_address=args.controller_address,
        api_keys=tuple(api_keys),
        admin_api_keys=tuple(args.admin_api_keys),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        cluster_secret=secret_from_env(args.cluster_secret),
        limits=RequestLimits(
            max_n=args.max_n,
            max_logprobs=args.max_logprobs,
            max_stop_sequences=args.max_stop_sequences,
            max_stop_length=args.max_stop_length,
            max_request_bytes=args.max_request_bytes,
        ),
        worker_timeout=args.worker_timeout,
        max_worker_attempts=args.max_worker_attempts,
        routing=RoutingMode(args.routing),
        worker_refresh_interval=args.worker_refresh_interval,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts.split(",")),
        max_streams_per_key=_positive_or_none(args.max_streams_per_key, "--max-streams-per-key"),
    )


def _positive_or_none(value: int, flag: str) -> int | None:
    if value < 0:
        raise ValueError(f"{flag} must be >= 0 (0: no cap), got {value}")
    return value or None


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        settings = settings_from_args(args)
        limits = connection_limits_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.shutdown_timeout > 0:
        parser.error("--shutdown-timeout must be > 0 seconds")
    app = create_app(settings)
    log_summary(logging.getLogger("llmplatform.openai_api"), "llmplatform gateway",
                gateway_summary(settings, listen_url(args.host, args.port)))
    # GatewayMetricsMiddleware logs one line per request, with its model and duration;
    # uvicorn's own access line would be a second one, written before the first byte is sent.
    run_server(app, host=args.host, port=args.port, log_level=args.log_level,
               shutdown_timeout=args.shutdown_timeout, access_log=False, limits=limits)


if __name__ == "__main__":
    main()
