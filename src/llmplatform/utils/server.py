"""Running an ASGI app on a real uvicorn server: as a service's main loop, or in a thread.

`run_server` is how every service's `__main__` serves: SIGTERM or SIGINT starts a graceful
shutdown (stop accepting, let in-flight requests finish for up to `shutdown_timeout` seconds,
cancel what is left, run the app's lifespan shutdown, exit); an `on_drain` hook runs on the event
loop the moment the signal arrives, before in-flight requests finish (a worker deregisters from
its controller there, so no new work is routed to it while it drains).

`serve_in_thread` serves tests and embedded use: real servers on ephemeral ports (house style);
this is the one place that knows how to start such a server, learn its port, and stop it without
leaking threads or sockets.

Both serve through the services' protocol (:mod:`llmplatform.utils.http_protocol`) under a
:class:`ConnectionLimits`: deadlines for a request's head and body, for a client that stops
reading, and a cap on open connections (every service's flags for them are declared once, in
`service_settings.ServerSettings`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from llmplatform.utils.http_protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_WRITE_STALL_TIMEOUT_S,
    ConnectionLimits,
    protocol_for,
)

logger = logging.getLogger("llmplatform.server")

STARTUP_TIMEOUT_S = 30.0
"""How long to wait for the server to bind and finish its lifespan startup."""
GRACEFUL_SHUTDOWN_S = 3.0
"""How long open connections (e.g. a hung stream) may delay shutdown before being cancelled."""
JOIN_TIMEOUT_S = 10.0
"""How long to wait for the server thread after asking it to exit, before forcing it."""
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""Services' default `--shutdown-timeout`: how long in-flight requests may run after SIGTERM
(Kubernetes' default grace period is 30 s too, after which it sends SIGKILL)."""

_FDS_PER_CONNECTION = 2
"""A gateway's client connection usually has a worker connection behind it."""
_SPARE_FDS = 256
"""Descriptors besides connections: model files, logs, the controller's and workers' pools."""

KEEP_ALIVE_S = 75.0
"""How long a client's idle connection stays open (uvicorn's default is 5 s). Clients built on
httpx, the official openai client included, drop idle connections after 5 s too: with equal
timers a request sent on a connection the moment the server closes it fails with a reset. Well
above the clients' timer, closing is theirs; 75 s is nginx's default. Idle connections still
count against ``--max-connections``."""

DrainHook = Callable[[], Awaitable[None]]


class _DrainingServer(uvicorn.Server):
    """A uvicorn server that also runs `on_drain` on its loop when the first exit signal arrives.

    uvicorn itself only notices the signal on its next tick (every 0.1 s) and then stops
    listening and waits for in-flight requests; the app's lifespan shutdown runs only after
    that. A hook that must run *before* the wait (deregistering, failing health checks) goes
    here.
    """

    def __init__(self, config: uvicorn.Config, on_drain: DrainHook | None) -> None:
        super().__init__(config)
        self._on_drain = on_drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it may interrupt the loop anywhere, so only hand the hook over.
        if self._on_drain is not None and self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._start_drain)
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain_task is None and self._on_drain is not None:
            self._drain_task = asyncio.get_running_loop().create_task(self._on_drain(), name="drain")


def run_server(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    on_drain: DrainHook | None = None,
    access_log: bool = True,
    limits: ConnectionLimits = ConnectionLimits(),
) -> None:
    """Serve `app` until SIGTERM/SIGINT, then shut down gracefully (see the module doc).

    `access_log=False` turns off uvicorn's access line, for a service that logs its own.

    After a signal-initiated shutdown uvicorn re-raises the signal with its default handler,
    so a parent sees the process end by SIGTERM (exit status -15), as for any service stopped
    that way. Exits with status 3 if the server cannot start (bind or lifespan failure).
    """
    if not shutdown_timeout > 0:
        raise ValueError(f"shutdown_timeout must be > 0 seconds, got {shutdown_timeout}")
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=shutdown_timeout,
        # The service configured logging (utils.logs.configure_logging): uvicorn's records go to
        # that handler, in that format (text or JSON), instead of uvicorn's own.
        log_config=None, access_log=access_log, http=protocol_for(limits),
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    _fit_file_limit(limits.max_connections)
    server = _DrainingServer(config, on_drain)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's own STARTUP_FAILURE status


def _url_host(host: str) -> str:
    # An IPv6 literal needs brackets inside a URL.
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _stop(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=JOIN_TIMEOUT_S)
    if thread.is_alive():
        # Skip the graceful wait for connections and background tasks.
        server.force_exit = True
        thread.join(timeout=JOIN_TIMEOUT_S)


@contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, *, limits: ConnectionLimits = ConnectionLimits()
) -> Iterator[str]:
    """Serve `app` on `host` at `port` (0: a free port the OS picks); yield the base URL
    (http://HOST:PORT). A fixed port lets a test restart a service at the same address.

    The app's lifespan runs (startup before the URL is yielded, shutdown on exit). Raises
    RuntimeError if the server cannot start (bind failure, failing lifespan startup) or does
    not start within STARTUP_TIMEOUT_S. Signal handlers are not installed: uvicorn only does
    that on the main thread, so Ctrl-C still reaches the caller.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=protocol_for(limits),
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{host}", daemon=True)
    thread.start()

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            # uvicorn calls sys.exit() on bind or lifespan failure; in a thread that just ends it.
            raise RuntimeError(f"uvicorn server on {host} failed to start (see its log)")
        if time.monotonic() > deadline:
            _stop(server, thread)
            raise RuntimeError(f"uvicorn server on {host} did not start in {STARTUP_TIMEOUT_S} s")
        time.sleep(0.005)

    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{_url_host(host)}:{port}"
    finally:
        _stop(server, thread)


def _fit_file_limit(max_connections: int | None) -> None:
    """Raise the soft limit on open files toward what `max_connections` needs (up to the hard
    limit, which only root can raise): a cap the process cannot reach protects nothing, and
    accept() failing with EMFILE is worse than a 503."""
    if max_connections is None:
        return
    needed = max_connections * _FDS_PER_CONNECTION + _SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        logger.warning("--max-connections %d needs about %d open files, but this process may open "
                       "only %d (ulimit -n); lower the cap or raise the limit", max_connections,
                       needed, target)
