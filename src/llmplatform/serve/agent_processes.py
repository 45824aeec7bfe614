"""The worker processes one agent started: spawn, watch, stop, and what each was admitted with.

A worker is started as ``python -m llmplatform.model_worker`` with its own port, the address it
registers under and the controller's address; its output goes to a log file whose last lines
explain an exit. Stopping is SIGTERM, which makes a worker deregister at once (routing stops) and
let its in-flight requests finish within its --shutdown-timeout; one still alive after that and a
margin is killed. Every child also gets SIGTERM if the agent dies (parent-death signal), and the
agent stops all of them when it stops itself, so none outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from llmplatform.protocol.lifecycle import (
    AgentProcess,
    LaunchModelRequest,
    LaunchWorkersRequest,
    ProcessState,
)
from llmplatform.serve.launch_checks import LaunchRefused
from llmplatform.serve.supervisor import STOP_MARGIN_S, die_with_parent, exit_description
from llmplatform.utils.cluster_secret import SECRET_ENV

logger = logging.getLogger("llmplatform.serve.agent")

LOG_TAIL_LINES = 8


@dataclass
class _Worker:
    address: str
    model_name: str
    proc: subprocess.Popen
    log_path: Path
    log: IO[bytes]
    reserved_bytes: int
    spec: LaunchModelRequest | None

    def describe(self) -> AgentProcess:
        code = self.proc.poll()
        return AgentProcess(
            worker_address=self.address, model_name=self.model_name, pid=self.proc.pid,
            state=ProcessState.RUNNING if code is None else ProcessState.EXITED,
            exit_reason=None if code is None else self.exit_reason(code),
            reserved_bytes=self.reserved_bytes if code is None else 0, spec=self.spec)

    def exit_reason(self, code: int) -> str:
        return exit_reason(code, self.log_path)


def exit_reason(code: int, log_path: Path) -> str:
    """How a worker ended and the last lines of its log."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        lines = []
    tail = " | ".join(line.strip() for line in lines if line.strip())
    return f"worker exited ({exit_description(code)}); its log ends: {tail or '(empty)'}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class WorkerCommand:
    """How an agent starts each worker on its host: the parts every worker shares."""

    host: str
    """Where workers bind."""
    reach: str
    """The host part of the address workers register under (their node's, for a wildcard bind)."""
    controller_address: str
    cluster_secret: str | None
    log_dir: Path
    shutdown_timeout: float
    log_args: tuple[str, ...]

    def argv(self, request: LaunchWorkersRequest, port: int) -> tuple[list[str], str]:
        """One worker's command line on `port`, and the address it registers under."""
        address = f"http://{self.reach}:{port}"
        argv = [sys.executable, "-m", "llmplatform.model_worker", "--host", self.host,
                "--port", str(port), "--worker-address", address, "--controller-address",
                self.controller_address, "--shutdown-timeout", f"{self.shutdown_timeout:g}",
                *self.log_args, "--model-path", request.model_path, "--model-names",
                request.model_name, "--backend", request.backend, *request.worker_args]
        if request.kv_cache_memory is not None:
            argv += ["--kv-cache-memory", request.kv_cache_memory]
        return argv, address

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.cluster_secret is not None:
            env[SECRET_ENV] = self.cluster_secret  # never on the command line (secret_flags.py)
        return env

    def log_path(self, request: LaunchWorkersRequest, port: int) -> Path:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"worker-{request.model_name.replace('/', '_')}-{port}.log"


class WorkerProcesses:
    def __init__(self, *, host: str, controller_address: str, cluster_secret: str | None,
                 log_dir: Path, shutdown_timeout: float, log_args: list[str]) -> None:
        self._command = WorkerCommand(
            host=host, reach="127.0.0.1" if host in ("0.0.0.0", "::") else host,
            controller_address=controller_address, cluster_secret=cluster_secret,
            log_dir=log_dir, shutdown_timeout=shutdown_timeout, log_args=tuple(log_args))
        self._shutdown_timeout = shutdown_timeout
        self._workers: dict[str, _Worker] = {}

    def reserved_bytes(self) -> int:
        """What the running workers were admitted with."""
        return sum(w.reserved_bytes for w in self._workers.values() if w.proc.poll() is None)

    def listing(self) -> list[AgentProcess]:
        return [w.describe() for w in self._workers.values()]

    def start(self, request: LaunchWorkersRequest, per_worker_bytes: int) -> list[AgentProcess]:
        """Start `replicas` workers (they load and register in the background): all or none,
        an OSError (no log folder, no fork) killing those this call started."""
        started: list[_Worker] = []
        try:
            for _ in range(request.replicas):
                started.append(self._spawn(request, per_worker_bytes))
        except OSError:
            for worker in started:
                worker.proc.kill()
                worker.proc.wait()
                worker.log.close()
                del self._workers[worker.address]
            raise
        return [worker.describe() for worker in started]

    async def launch(self, request: LaunchWorkersRequest,
                     per_worker_bytes: int) -> list[AgentProcess]:
        """The agent's launch (``agent.py``): `start`, its OSError a 503."""
        # On the loop's own thread: a child's parent-death signal follows the thread that
        # forked it, and a pool thread may end while the worker runs.
        try:
            return self.start(request, per_worker_bytes)
        except OSError as exc:
            raise LaunchRefused(f"the workers could not be started: {exc}", 503) from None

    def _spawn(self, request: LaunchWorkersRequest, per_worker_bytes: int) -> _Worker:
        port = free_port(self._command.host)
        argv, address = self._command.argv(request, port)
        env = self._command.env()
        log_path = self._command.log_path(request, port)
        log = open(log_path, "ab")  # noqa: SIM115 (the child writes to it until it exits)
        try:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=die_with_parent)
        except OSError:
            log.close()
            raise
        logger.info("started worker %s for %s (pid %d, log %s)", address, request.model_name,
                    proc.pid, log_path)
        worker = _Worker(address, request.model_name, proc, log_path, log, per_worker_bytes,
                         request.spec)
        self._workers[address] = worker
        return worker

    def knows(self, address: str) -> bool:
        return address in self._workers

    async def stop(self, address: str) -> AgentProcess:
        """SIGTERM the worker and wait until it has exited (drained, or killed after its grace);
        it is then forgotten. Returns its last description."""
        worker = self._workers[address]
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
            logger.info("stopping worker %s (pid %d)", address, worker.proc.pid)
            try:
                await asyncio.to_thread(worker.proc.wait, self._shutdown_timeout + STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                logger.warning("worker %s did not stop in time; killing it", address)
                worker.proc.kill()
                await asyncio.to_thread(worker.proc.wait)
        described = worker.describe()
        self._workers.pop(address, None)
        worker.log.close()
        return described

    def terminate_all(self) -> None:
        """SIGTERM every running worker, without waiting (serve's stop: all services at once)."""
        for worker in list(self._workers.values()):
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)

    def wait_all(self, deadline: float) -> None:
        """Wait (blocking: serve's own thread) until every worker exited; kill those still
        running at `deadline` (a time.monotonic() reading)."""
        for worker in list(self._workers.values()):
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(address) for address in list(self._workers)))
