"""The settings every service shares, declared once: logging, and for the HTTP services their
bind address, drain grace, cluster secret, request guard and connection limits.

A service's model extends `LoggingSettings` (the web UI) or `ServerSettings` (controller, worker,
gateway) and redeclares a shared field where its default or help differs (each its own `--port`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from llmplatform.utils.http_protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_WRITE_STALL_TIMEOUT_S,
    ConnectionLimits,
)
from llmplatform.utils.logs import LOG_FORMATS, LOG_LEVELS
from llmplatform.utils.request_guard import (
    DEFAULT_MAX_BODY_BYTES,
    RequestGuardConfig,
    allowed_hosts_for,
    guard_config,
)
from llmplatform.utils.server import DEFAULT_SHUTDOWN_TIMEOUT_S, run_server
from llmplatform.utils.settings import CommaList, OptionalText, ServiceSettings, option

LogLevel = Literal[LOG_LEVELS]  # type: ignore[valid-type]
LogFormat = Literal[LOG_FORMATS]  # type: ignore[valid-type]

_CONNECTIONS = "connections (slow and greedy clients; 0 turns one off)"
ALLOWED_HOSTS_HELP = (
    "comma-separated host names the service may be called by (the Host header; any port). Bound "
    "to loopback, 127.0.0.1, localhost and [::1] are always allowed and any other name is refused "
    "with 400 (DNS rebinding); bound elsewhere, no check unless names are given here. '*' turns "
    "the check off")
"""`--allowed-hosts` of every HTTP service (`request_guard.allowed_hosts_for`), the web UI's too."""


class LoggingSettings(ServiceSettings):
    log_level: LogLevel = option("info", "lowest level logged (default: %(default)s)",
                                 group="logging")
    log_format: LogFormat = option(
        "text", "text: one human-readable line per event; json: one JSON object per line (time, "
        "level, logger, message, request_id, ...) (default: %(default)s)", group="logging")


class ServerSettings(LoggingSettings):
    host: str = option("127.0.0.1", "bind address (default: %(default)s)")
    port: int = option(0, "bind port; 0 picks a free one (default: %(default)s)")
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S, "on SIGTERM: stop accepting, let in-flight requests run this "
        "long, then exit (default: %(default)s)", metavar="SECONDS", gt=0)
    cluster_secret: OptionalText = option(
        None, "the cluster's shared secret (prefer $LLMPLATFORM_CLUSTER_SECRET: flags show in ps)",
        secret=True)
    allowed_hosts: CommaList = option((), ALLOWED_HOSTS_HELP, metavar="NAMES")
    max_request_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, "largest request body in bytes; larger is refused with 413 before "
        "it is read whole (default: %(default)s)", ge=1)
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS, "open connections at most; one more is refused as it is "
        "accepted, with a 503 (default: %(default)s)", metavar="N", group=_CONNECTIONS, ge=0)
    request_head_timeout: float = option(
        DEFAULT_HEAD_TIMEOUT_S, "a request's headers must arrive within this long of the "
        "connection opening (of its first byte on a kept-alive connection), or the connection is "
        "closed (default: %(default)s)", metavar="SECONDS", group=_CONNECTIONS, ge=0)
    request_body_timeout: float = option(
        DEFAULT_BODY_TIMEOUT_S, "a request's body must arrive within this long of its headers, "
        "or the connection is closed (default: %(default)s)", metavar="SECONDS",
        group=_CONNECTIONS, ge=0)
    write_stall_timeout: float = option(
        DEFAULT_WRITE_STALL_TIMEOUT_S, "a client that stops reading its response (a stream "
        "included) for this long is cut off and its request aborted, freeing its worker slot "
        "(default: %(default)s)", metavar="SECONDS", group=_CONNECTIONS, ge=0)

    def run(self, app: Any, **options: Any) -> None:
        """Serve `app` on `host`:`port` until SIGTERM, with these limits and drain grace
        (`utils.server.run_server`; `options`: its other arguments)."""
        run_server(app, host=self.host, port=self.port, log_level=self.log_level,
                   shutdown_timeout=self.shutdown_timeout, limits=self.connection_limits(),
                   **options)

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            max_connections=self.max_connections or None,
            head_timeout_s=self.request_head_timeout or None,
            body_timeout_s=self.request_body_timeout or None,
            write_stall_timeout_s=self.write_stall_timeout or None,
        )

    def allowed_host_names(self) -> frozenset[str] | None:
        """The Host names a request may use (None: any), from `host` and `allowed_hosts`."""
        return allowed_hosts_for(self.host, self.allowed_hosts)

    def guard_config(self, own_names: Iterable[str | None] = ()) -> RequestGuardConfig:
        """The request guard (`request_guard`); `own_names`: the host of an address the service
        announces, allowed whenever Host is checked at all."""
        return guard_config(self.host, self.allowed_hosts, max_body_bytes=self.max_request_bytes,
                            own_names=own_names)
