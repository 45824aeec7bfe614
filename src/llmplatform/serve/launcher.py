"""``llmplatform serve``: a controller, one or more model workers and the gateway, one command.

Each service runs in its own process (as in a real deployment, and so one model's crash cannot
take the others down). The launcher starts them in dependency order, waits until each answers,
prints where each listens, and on Ctrl-C/SIGTERM, or when any service dies, stops them all.
Children also get SIGTERM if the launcher itself is killed (Linux parent-death signal), so no
orphan keeps a port or a model in memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from llmplatform.utils.logs import configure_logging

logger = logging.getLogger("llmplatform.serve")

STOP_GRACE_S = 10.0


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    health_url: str
    url: str


@dataclass
class ClusterSpec:
    host: str = "127.0.0.1"
    controller_port: int = 21001
    api_port: int = 8000
    worker_port_base: int = 21002
    workers: list[list[str]] = field(default_factory=lambda: [[]])
    controller_args: list[str] = field(default_factory=list)
    api_args: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmplatform serve",
        description="Start a controller, model worker(s) and the OpenAI-compatible gateway. "
                    "With no --worker/--config: one worker serving the embedded default model.")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of every service")
    parser.add_argument("--controller-port", type=int, default=21001)
    parser.add_argument("--api-port", type=int, default=8000)
    parser.add_argument("--worker-port-base", type=int, default=21002,
                        help="workers without --port get consecutive ports from here")
    parser.add_argument("--worker", action="append", default=None, metavar="'WORKER FLAGS'",
                        help="one worker, given as its own flags in one quoted string, e.g. "
                             "--worker '--model-path ./m --model-names m --backend hf'. Repeatable.")
    parser.add_argument("--config", type=Path, default=None,
                        help="a cluster TOML file (see README: [controller], [api], [[worker]])")
    parser.add_argument("--api-keys", default=None, help="comma-separated API keys for the gateway")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for each service (the first start converts the "
                             "default model once)")
    return parser


def _flags_from_table(table: dict) -> list[str]:
    """TOML keys mirror the command-line flags: model_path = "x" -> --model-path x."""
    argv: list[str] = []
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    spec = ClusterSpec(host=args.host, controller_port=args.controller_port,
                       api_port=args.api_port, worker_port_base=args.worker_port_base)
    if args.config is not None:
        import tomllib

        try:
            data = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SystemExit(f"error: cannot read {args.config}: {exc}") from exc
        controller = dict(data.get("controller", {}))
        api = dict(data.get("api", {}))
        spec.host = str(data.get("host", spec.host))
        spec.controller_port = int(controller.pop("port", spec.controller_port))
        spec.api_port = int(api.pop("port", spec.api_port))
        spec.controller_args = _flags_from_table(controller)
        spec.api_args = _flags_from_table(api)
        workers = data.get("worker", data.get("workers", []))
        if not isinstance(workers, list) or not workers:
            raise SystemExit(f"error: {args.config} has no [[worker]] tables")
        spec.workers = [_flags_from_table(dict(w)) for w in workers]
    if args.worker:
        spec.workers = ([] if args.config is None else spec.workers) + [shlex.split(w) for w in args.worker]
    if args.api_keys:
        spec.api_args += ["--api-keys", args.api_keys]
    return spec


def services_for(spec: ClusterSpec) -> list[ServiceSpec]:
    py = [sys.executable, "-m"]
    host = spec.host
    reach = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    controller_url = f"http://{reach}:{spec.controller_port}"
    services = [ServiceSpec("controller",
                            py + ["llmplatform.controller", "--host", host,
                                  "--port", str(spec.controller_port)] + spec.controller_args,
                            f"{controller_url}/health", controller_url)]
    next_port = spec.worker_port_base
    used_ports = {spec.controller_port, spec.api_port}
    for i, worker_args in enumerate(spec.workers):
        if "--port" in worker_args:
            port = int(worker_args[worker_args.index("--port") + 1])
            extra: list[str] = []
        else:
            while next_port in used_ports:
                next_port += 1
            port = next_port
            extra = ["--port", str(port)]
        used_ports.add(port)
        url = f"http://{reach}:{port}"
        if "--worker-address" not in worker_args:
            extra += ["--worker-address", url]
        services.append(ServiceSpec(
            f"worker {i}", py + ["llmplatform.model_worker", "--host", host,
                                 "--controller-address", controller_url] + extra + worker_args,
            f"{url}/health", url))
    api_url = f"http://{reach}:{spec.api_port}"
    services.append(ServiceSpec("api", py + ["llmplatform.openai_api", "--host", host,
                                             "--port", str(spec.api_port), "--controller-address",
                                             controller_url] + spec.api_args,
                                f"{api_url}/health", api_url))
    return services


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


class Cluster:
    def __init__(self, services: list[ServiceSpec], startup_timeout: float) -> None:
        self.services = services
        self.startup_timeout = startup_timeout
        self.procs: list[tuple[ServiceSpec, subprocess.Popen]] = []

    def start(self) -> None:
        for service in self.services:
            logger.info("starting %s: %s", service.name, shlex.join(service.argv))
            proc = subprocess.Popen(service.argv, preexec_fn=_die_with_parent if os.name == "posix" else None)
            self.procs.append((service, proc))
            self._wait_healthy(service, proc)
            print(f"llmplatform serve: {service.name} ready at {service.url}", flush=True)

    def _wait_healthy(self, service: ServiceSpec, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{service.name} exited with code {proc.returncode} during startup")
            try:
                if httpx.get(service.health_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{service.name} did not become healthy within {self.startup_timeout:.0f} s")

    def wait(self) -> int:
        """Blocks until a service exits; returns its exit code."""
        while True:
            for service, proc in self.procs:
                code = proc.poll()
                if code is not None:
                    print(f"llmplatform serve: {service.name} exited with code {code}; stopping",
                          file=sys.stderr, flush=True)
                    return code or 1
            time.sleep(0.5)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for service, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", service.name)
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging("info")
    spec = spec_from_args(args)
    cluster = Cluster(services_for(spec), args.startup_timeout)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT explicitly too: a shell starting us in the background leaves it ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        cluster.start()
        api = cluster.services[-1].url
        print(f"llmplatform serve: OpenAI API at {api}/v1  (Ctrl-C stops everything)", flush=True)
        code = cluster.wait()
    except KeyboardInterrupt:
        print("llmplatform serve: stopping", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"llmplatform serve: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
    raise SystemExit(code)
