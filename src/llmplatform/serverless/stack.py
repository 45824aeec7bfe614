"""The serving stack behind the handler: a controller, one model worker and the gateway, each its
own child process on loopback, started and supervised the way `llmplatform serve` does it
(`serve/launcher.py` builds their command lines, `serve/supervisor.py` runs them), without the
web UI. Jobs reach the gateway over HTTP, so a job's answer is the gateway's by construction.

A child that dies is restarted by the supervisor (on a thread beside the SDK's loop); when the
supervisor gives up (a crash loop of the gateway or controller, or of the only worker), the
process sends itself SIGTERM: the SDK shuts down and RunPod replaces the worker.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
from dataclasses import dataclass

import httpx

from llmplatform.serve.down_report import DownReporter
from llmplatform.serve.launcher import ADMIN_KEYS_ENV, API_KEYS_ENV, ClusterSpec, services_for
from llmplatform.serve.supervisor import POLL_INTERVAL_S, ServiceSpec, Supervisor
from llmplatform.serverless.config import ServerlessConfig
from llmplatform.utils.cluster_secret import secret_headers

logger = logging.getLogger("llmplatform.serverless")

LOOPBACK = "127.0.0.1"
SHUTDOWN_TIMEOUT_S = 10.0
"""Each service's --shutdown-timeout: the SDK has finished (or abandoned) its jobs by the time the
stack stops, so there is little to drain."""
_STATUS_TIMEOUT_S = 30.0


class _StoppableSupervisor(Supervisor):
    """`Supervisor.run`'s loop, ended by an event so that `stop` never races a restart."""

    def run_until(self, stopping: threading.Event) -> int | None:
        while not stopping.is_set():
            for service in self.services:
                code = self._check(service)
                if code is not None:
                    return code
            stopping.wait(POLL_INTERVAL_S)
        return None


@dataclass
class WorkerFacts:
    model: str
    """The first name the model is served under."""
    capacity: int
    """Requests the worker runs at once (`/worker_get_status`' `max_num_running`)."""


class Stack:
    def __init__(self, config: ServerlessConfig) -> None:
        controller_port, worker_port, free_api_port = _free_ports(3)
        self.secret = secrets.token_urlsafe(32)
        spec = ClusterSpec(host=LOOPBACK, controller_port=controller_port,
                           api_port=config.gateway_port or free_api_port,
                           worker_port_base=worker_port, workers=[list(config.worker_args)],
                           webui=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                           cluster_secret=self.secret)
        self.services: list[ServiceSpec] = services_for(spec)
        by_name = {service.name: service for service in self.services}
        # Only the handler calls the gateway, on loopback, and RunPod authenticates the callers:
        # keys meant for a standalone gateway ($LLMPLATFORM_API_KEYS) would lock the handler out.
        by_name["api"].env.update({API_KEYS_ENV: "", ADMIN_KEYS_ENV: ""})
        self.gateway_url = by_name["api"].url
        self.worker_url = by_name["worker 0"].url
        self._supervisor = _StoppableSupervisor(
            self.services, startup_timeout=config.startup_timeout_s,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            on_state=DownReporter(by_name["controller"].url, self.secret))
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> WorkerFacts:
        """Starts every service (RuntimeError if one cannot start), then supervises them on a
        thread; returns what the handler needs to know about the worker."""
        self._supervisor.start()
        self._thread = threading.Thread(target=self._supervise, name="serverless-supervisor",
                                        daemon=True)
        self._thread.start()
        status = httpx.post(f"{self.worker_url}/worker_get_status", trust_env=False,
                            headers=secret_headers(self.secret), timeout=_STATUS_TIMEOUT_S)
        status.raise_for_status()
        facts = status.json()
        return WorkerFacts(model=facts["model_names"][0], capacity=int(facts["max_num_running"]))

    def _supervise(self) -> None:
        code = self._supervisor.run_until(self._stopping)
        if code is not None:
            logger.error("the serving stack cannot serve any more (exit code %d): stopping this "
                         "worker", code)
            os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        self._supervisor.stop()


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free right now (held together until all are picked)."""
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
