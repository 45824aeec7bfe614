"""Real parts for the fault tests: services as subprocesses (so that killing one really cuts its
sockets) and in-process servers on ephemeral ports.

Waits go through tests/polling.py (bounded, failing with what was awaited); every process started
here is killed and reaped on exit, whatever the test did to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.llm.base import LLMBackend
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.server import serve_in_thread

from tests.polling import wait_until
from tests.processes import free_port

if TYPE_CHECKING:
    from tests.faults.faulty_runner import Faults

MODEL = "tiny"
SUBPROCESS_START_TIMEOUT_S = 120.0
"""A worker subprocess imports torch and loads the tiny model: seconds when idle, longer on a
loaded 2-core CI machine."""


def list_models(controller_url: str) -> list[str]:
    try:
        return httpx.post(f"{controller_url}/list_models", timeout=5).json()["models"]
    except httpx.HTTPError:
        return []


def worker_status(worker_url: str) -> dict[str, Any]:
    return httpx.post(f"{worker_url}/worker_get_status", timeout=10).json()


def idle(status: dict[str, Any]) -> dict[str, Any]:
    """The facts that must be back at their baseline once no request is left on a worker."""
    return {key: status[key] for key in ("num_running", "num_waiting", "num_accepted",
                                         "num_slots_in_use", "num_free_kv_blocks")}


def controller_app(*, heartbeat_expiration: float = 10.0, rng: Any = None) -> Any:
    return create_controller_app(ControllerConfig(heartbeat_expiration=heartbeat_expiration), rng=rng)


def gateway_app(controller_url: str, *, rng: Any = None, **settings: Any) -> Any:
    """A gateway; `rng` draws its routing table's random picks (see FirstCandidate). The load
    tests send 100 requests at once from one address: past the per-key default (64), so the
    tenant limit is off unless a test sets it."""
    from llmplatform.openai_api.settings import TenantLimits

    settings.setdefault("tenant_limits", TenantLimits(max_concurrent_requests=None))
    return create_gateway_app(GatewaySettings(controller_address=controller_url, **settings), rng=rng)


def worker_app(llm: LLMBackend, controller_url: str | None, **settings: Any) -> Any:
    values: dict[str, Any] = dict(worker_address=None, controller_address=controller_url,
                                  register=controller_url is not None,
                                  limit_worker_concurrency=llm.default_concurrency,
                                  heartbeat_interval=0.5)
    values.update(settings)
    return create_worker_app(llm, WorkerSettings(**values))


@contextlib.contextmanager
def serve_worker(app: Any, *, port: int = 0) -> Iterator[str]:
    """An in-process worker; its registration starts once its address is known."""
    with serve_in_thread(app, port=port) as url:
        app.state.worker_address = url
        yield url


class FirstCandidate:
    """A controller (or gateway) `rng` that always draws 0: ties go to the first live worker by
    name, so a test knows which of two idle workers the controller picks. A gateway routing
    from its own table ranks with the same method, so it needs the same source to pick alike."""

    def random(self) -> float:
        return 0.0


# ---- services as subprocesses ------------------------------------------------------------------


@dataclass
class Service:
    """A service run as `python -m ...`; its output goes to `log` for the failure message."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    health_url: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the kernel closes every socket at once, nothing runs in the process."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # One torch thread per subprocess: tests share a small machine with the pytest process.
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(extra or {}))


def start_service(module: str, args: list[str], log: Path, health_url: str, url: str,
                  env: dict[str, str] | None = None) -> Service:
    """Start `python -m module args` (not waiting for it); see :func:`services`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                                stderr=subprocess.STDOUT, env=_env(env))
    return Service(proc, url, log, health_url)


def wait_healthy(service: Service, timeout_s: float = SUBPROCESS_START_TIMEOUT_S) -> None:
    def healthy() -> bool:
        if service.proc.poll() is not None:  # it will never be healthy: fail now
            raise AssertionError(f"{service.url} exited with {service.proc.returncode}:\n{service.output()}")
        return httpx.get(service.health_url, timeout=2).status_code == 200

    wait_until(healthy, timeout_s=timeout_s, interval_s=0.1, retry_on=(httpx.HTTPError,),
               what=f"{service.url} healthy", context=service.output)


@contextlib.contextmanager
def services(*started: Service) -> Iterator[list[Service]]:
    """Wait until every started service is healthy (they start in parallel); kill and reap
    them all on exit, whatever state the test left them in."""
    try:
        for service in started:
            wait_healthy(service)
        yield list(started)
    finally:
        for service in started:
            if service.proc.poll() is None:
                service.proc.kill()
            service.proc.wait(timeout=30)


def start_worker(model_dir: Path, controller_url: str, log_dir: Path, *, name: str = "worker",
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 faults: Faults | None = None) -> Service:
    """A paged tiny-model worker, `python -m llmplatform.model_worker`, registering with
    `controller_url` (heartbeat every 0.5 s). With `faults`, the same worker started through
    `tests.faults.faulty_worker`, whose engine injects them."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model-path", str(model_dir), "--model-names", MODEL, "--backend", "paged",
            "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "64MiB",
            "--port", str(port), "--controller-address", controller_url,
            "--heartbeat-interval", "0.5", "--log-level", "info", *(extra or [])]
    module = "llmplatform.model_worker"
    if faults is not None:
        module, args = "tests.faults.faulty_worker", [json.dumps(dataclasses.asdict(faults)), *args]
    return start_service(module, args, log_dir / f"{name}.log", f"{url}/health", url, env)
