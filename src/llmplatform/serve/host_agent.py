"""`llmplatform serve`'s host agent: the agent app (``agent.py``) served from serve's own process,
on a thread beside the supervisor, so that one command still runs everything and the workers
launched at runtime are serve's children like the others (and stop with it).

Its port is free by default (0): the agent registers with the controller under the address it
got, so nothing needs to know it beforehand. A host without serve runs the same agent alone
(``python -m llmplatform.serve.agent_main``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from llmplatform.serve.agent import AgentConfig, start_agent
from llmplatform.serve.supervisor import STOP_MARGIN_S, Supervisor
from llmplatform.utils.sizes import parse_size


def host_agent_config(settings: Any, spec: Any, controller_url: str) -> AgentConfig:
    """The agent's config from serve's settings (`ServeSettings`) and cluster (`ClusterSpec`)."""
    limit = settings.agent_memory_limit
    try:
        limit_bytes = None if limit is None else parse_size(limit)
    except ValueError as exc:
        raise SystemExit(f"error: --agent-memory-limit: {exc}") from None
    return AgentConfig(
        controller_address=controller_url, host=spec.host, cluster_secret=spec.cluster_secret,
        memory_limit_bytes=limit_bytes,
        log_dir=settings.log_dir or Path("/tmp/llmplatform-agent"),
        worker_shutdown_timeout=spec.shutdown_timeout, log_args=tuple(spec.log_args))


class WithHostAgent:
    """A :class:`Supervisor` deployment plus the host agent: started after the supervisor's
    services (the controller is up to register with), stopped with them."""

    def __init__(self, supervisor: Supervisor, config: AgentConfig, *, port: int) -> None:
        self._supervisor = supervisor
        self._config = config
        self._port = port
        self._stack = contextlib.ExitStack()
        self._app: Any = None

    def start(self) -> None:
        self._supervisor.start()
        self._app, url = start_agent(self._stack, self._config, self._port)
        print(f"llmplatform serve: host agent ready at {url}", flush=True)

    def run(self) -> int:
        return self._supervisor.run()

    def stop(self) -> None:
        # Everything at once, as the supervisor does: runtime workers drain beside the others.
        processes = self._app.state.processes if self._app is not None else None
        if processes is not None:
            processes.terminate_all()
        self._supervisor.stop()
        if processes is not None:
            processes.wait_all(time.monotonic() + self._config.worker_shutdown_timeout
                               + STOP_MARGIN_S)
        self._stack.close()
