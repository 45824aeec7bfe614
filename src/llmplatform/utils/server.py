"""Run an ASGI app on a real uvicorn server in a background thread (tests, embedded use).

Tests talk to real servers on ephemeral ports (house style), and several services sometimes
share one process (e.g. `llmplatform serve`); this is the one place that knows how to start such
a server, learn its port, and stop it without leaking threads or sockets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

STARTUP_TIMEOUT_S = 30.0
"""How long to wait for the server to bind and finish its lifespan startup."""
GRACEFUL_SHUTDOWN_S = 3.0
"""How long open connections (e.g. a hung stream) may delay shutdown before being cancelled."""
JOIN_TIMEOUT_S = 10.0
"""How long to wait for the server thread after asking it to exit, before forcing it."""


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
def serve_in_thread(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve `app` on `host` at a free port the OS picks; yield the base URL (http://HOST:PORT).

    The app's lifespan runs (startup before the URL is yielded, shutdown on exit). Raises
    RuntimeError if the server cannot start (bind failure, failing lifespan startup) or does
    not start within STARTUP_TIMEOUT_S. Signal handlers are not installed: uvicorn only does
    that on the main thread, so Ctrl-C still reaches the caller.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=0,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
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
