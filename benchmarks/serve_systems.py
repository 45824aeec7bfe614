"""Starting and stopping the systems that ``benchmarks/serve.py --all`` compares, one at a time.

- an llmplatform cluster (``llmplatform serve --no-webui``: controller, one worker, gateway) as one
  subprocess, on free ports, with the worker's flags given; ready once the gateway lists the model;
- ``transformers serve`` (transformers' own OpenAI-compatible server) as a subprocess, offline,
  with the model preloaded from its local directory; ready once ``/health`` answers;
- llama.cpp's ``llama-server`` on a GGUF of the same model (``build_llamacpp.py`` builds both),
  with a fixed number of slots and threads; ready once ``/health`` answers.

Each system's output goes to a log file; when one fails to start, the error names the file and
quotes its last lines. Stopping sends SIGINT (the launcher stops its services in order) or SIGTERM,
waits, and kills only this system's own processes (the tree under the subprocess) if needed.
Also here: :class:`CoresMonitor`, which says who used the CPU during a run.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from cpu_usage import machine_cpu_seconds

from llmplatform.utils.cluster_secret import SECRET_ENV, secret_from_env, secret_headers

CLUSTER_SECRET = secret_from_env(None) or secrets.token_urlsafe(32)
"""The secret of the clusters this run starts (serve closes registration with one; the benchmark
calls the worker directly too). Handed to each process it starts in that process's environment,
never set in this process's own (an importing test must not leak it into later tests)."""


def cluster_headers() -> dict[str, str]:
    """Headers a benchmark client sends to reach a service of a cluster this run started."""
    return secret_headers(CLUSTER_SECRET)

STOP_GRACE_S = 30.0


class SystemStartError(RuntimeError):
    pass


def free_ports(count: int) -> list[int]:
    """Ports the OS has just handed out (bound together so they differ, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the benchmark dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class ManagedProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> "ManagedProcess":
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        return cls(name, proc, log_path)

    def pids(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def cpu_seconds(self) -> float:
        return sum(_cpu_seconds(pid) for pid in self.pids())

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemStartError(f"{self.name} exited with code {self.proc.returncode} during startup "
                                       f"(log {self.log_path}):\n{self.log_tail()}")
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemStartError(f"{self.name} was not ready within {timeout_s:.0f} s (log {self.log_path}):\n"
                               f"{self.log_tail()}")

    def stop(self, stop_signal: int = signal.SIGTERM) -> None:
        if self.proc.poll() is not None:
            return
        tree = descendants(self.proc.pid)
        self.proc.send_signal(stop_signal)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in tree:  # only processes this system started, by id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------------------------
# The systems


@dataclass
class LLMPlatformCluster:
    process: ManagedProcess
    gateway_url: str  # OpenAI base URL, .../v1
    worker_url: str

    def stop(self) -> None:
        self.process.stop(signal.SIGINT)  # the launcher's Ctrl-C path stops every service


def start_llmplatform(model_path: str, model_name: str, worker_args: str, log_path: Path,
                      startup_timeout_s: float, env: dict[str, str] | None = None) -> LLMPlatformCluster:
    """`llmplatform serve` of one worker; `env`: more environment for its services (their
    settings as `LLMPLATFORM_*` variables)."""
    controller_port, api_port, worker_port = free_ports(3)
    worker = f"--model-path {shlex.quote(model_path)} --model-names {shlex.quote(model_name)} {worker_args}"
    argv = [sys.executable, "-m", "llmplatform.cli", "serve", "--host", "127.0.0.1",
            "--controller-port", str(controller_port), "--api-port", str(api_port),
            "--worker-port-base", str(worker_port), "--worker", worker,
            "--no-webui"]  # the web UI (gradio) would start, and use the cores, during the runs
    process = ManagedProcess.start("llmplatform serve", argv, log_path,
                                   env={SECRET_ENV: CLUSTER_SECRET, **(env or {})})
    gateway = f"http://127.0.0.1:{api_port}/v1"

    def ready() -> bool:  # the gateway is up and the worker has registered
        response = httpx.get(f"{gateway}/models", timeout=5.0, trust_env=False)
        return response.status_code == 200 and any(m.get("id") == model_name for m in response.json()["data"])

    try:
        process.wait_ready(ready, startup_timeout_s)
    except BaseException:
        process.stop(signal.SIGINT)
        raise
    return LLMPlatformCluster(process, gateway, f"http://127.0.0.1:{worker_port}")


def start_bare_proxy(worker_url: str, log_path: Path, startup_timeout_s: float) -> tuple[ManagedProcess, str]:
    """``bare_proxy.py`` in front of `worker_url`: (the process, its OpenAI base URL)."""
    (port,) = free_ports(1)
    argv = [sys.executable, str(Path(__file__).with_name("bare_proxy.py")), "--port", str(port),
            "--worker", worker_url]
    process = ManagedProcess.start("bare proxy", argv, log_path, env={SECRET_ENV: CLUSTER_SECRET})
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(process, base, startup_timeout_s)
    return process, f"{base}/v1"


def _wait_healthy(process: ManagedProcess, base: str, timeout_s: float) -> None:
    """Until ``GET {base}/health`` answers 200; the process is stopped if it never does."""

    def ready() -> bool:
        return httpx.get(f"{base}/health", timeout=5.0, trust_env=False).status_code == 200

    try:
        process.wait_ready(ready, timeout_s)
    except BaseException:
        process.stop(signal.SIGTERM)
        raise


@dataclass
class TransformersServe:
    process: ManagedProcess
    base_url: str

    def stop(self) -> None:
        self.process.stop(signal.SIGTERM)


def transformers_cli() -> list[str]:
    """The ``transformers`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("transformers")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]


def start_transformers_serve(model_path: str, serve_args: str, log_path: Path,
                             startup_timeout_s: float) -> TransformersServe:
    (port,) = free_ports(1)
    argv = [*transformers_cli(), "serve", model_path, "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(serve_args)]
    # Offline: the model is a local directory; nothing may be fetched from a hub.
    process = ManagedProcess.start("transformers serve", argv, log_path,
                                   env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(process, base, startup_timeout_s)
    return TransformersServe(process, f"{base}/v1")


@dataclass
class LlamaServer:
    process: ManagedProcess
    base_url: str

    def stop(self) -> None:
        self.process.stop(signal.SIGTERM)


def start_llama_server(binary: str, gguf: str, alias: str, *, slots: int, context_per_slot: int, threads: int,
                       log_path: Path, startup_timeout_s: float, extra_args: str = "") -> LlamaServer:
    """llama.cpp's ``llama-server`` on a free port: ``slots`` parallel sequences (``-np``) sharing a
    context of ``slots * context_per_slot`` tokens (``-c``; each slot gets its share), ``threads``
    for decode and for prompt batches, the model served under ``alias``. Ready once ``/health``
    answers 200 (503 while the model loads)."""
    (port,) = free_ports(1)
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
            "-np", str(slots), "-c", str(slots * context_per_slot), "-t", str(threads), "-tb", str(threads),
            *shlex.split(extra_args)]
    process = ManagedProcess.start("llama-server", argv, log_path)
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(process, base, startup_timeout_s)
    return LlamaServer(process, f"{base}/v1")


# ---------------------------------------------------------------------------------------------
# CPU accounting


class CoresMonitor:
    """Average cores used during a run by the system under test (its whole process tree), by
    this client process, and by everything else on the machine (``/proc/stat`` busy time minus
    both), and the cores the hypervisor took from this VM (``steal``). On a shared machine, runs
    with ``other`` or ``steal`` well above 0 are slowed down."""

    def __init__(self, server: ManagedProcess | None) -> None:
        self.server = server

    def _snapshot(self) -> tuple[float, float, float, float, float]:
        busy, steal = machine_cpu_seconds()
        server = self.server.cpu_seconds() if self.server is not None else 0.0
        return time.perf_counter(), busy, server, time.process_time(), steal

    def start(self) -> None:
        self._start = self._snapshot()

    def stop(self) -> dict[str, float]:
        end = self._snapshot()
        wall = max(1e-9, end[0] - self._start[0])
        server = (end[2] - self._start[2]) / wall
        client = (end[3] - self._start[3]) / wall
        busy = (end[1] - self._start[1]) / wall
        return {"server_cores": round(server, 2), "client_cores": round(client, 2),
                "other_cores": round(max(0.0, busy - server - client), 2),
                "steal_cores": round((end[4] - self._start[4]) / wall, 2)}
