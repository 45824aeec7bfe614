"""`python -m llmplatform.openai_api`: parse flags, build the app, run uvicorn."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from llmplatform.openai_api.app import create_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.logs import configure_logging


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
        "--api-keys", type=_csv, default=[], help="Comma-separated keys; when set, /v1 needs one."
    )
    parser.add_argument(
        "--admin-api-keys",
        type=_csv,
        default=[],
        help="Comma-separated keys for /v1/admin (e.g. reset_prefix_cache); they also work for /v1. "
        "Without them, every --api-keys key is an admin key.",
    )
    parser.add_argument("--allowed-origins", type=_csv, default=["*"], help="Comma-separated CORS origins.")
    parser.add_argument("--allowed-methods", type=_csv, default=["*"])
    parser.add_argument("--allowed-headers", type=_csv, default=["*"])
    parser.add_argument("--allow-credentials", action="store_true")
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=600.0,
        help="Seconds a worker may stay silent before the request fails with 504.",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        controller_address=args.controller_address,
        api_keys=tuple(args.api_keys),
        admin_api_keys=tuple(args.admin_api_keys),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        worker_timeout=args.worker_timeout,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    app = create_app(settings_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
