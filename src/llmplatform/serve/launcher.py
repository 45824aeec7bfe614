"""``llmplatform serve``: a controller, one or more model workers and the gateway, one command.

Each service runs in its own process (as in a real deployment, and so one model's crash cannot
take the others down). The launcher starts them in dependency order, waits until each answers,
prints where each listens, and on Ctrl-C/SIGTERM, or when any service dies, stops them all:
each gets SIGTERM and its `--shutdown-timeout` to finish in-flight requests (workers deregister
at once), and whatever is still running after that (plus a small margin) is killed.
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
from llmplatform.utils.cli import apply_env_defaults, argv_from_mapping, env_var_for, find_action
from llmplatform.utils.cluster_secret import SECRET_ENV, secret_from_env
from llmplatform.utils.logs import add_logging_flags, configure_logging

logger = logging.getLogger("llmplatform.serve")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""Passed on to every service as its --shutdown-timeout (in-flight requests' grace period)."""
STOP_MARGIN_S = 5.0
"""Beyond a service's shutdown timeout: time for its lifespan shutdown before it is killed."""


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
    webui: bool = True
    webui_port: int = 7860
    webui_args: list[str] = field(default_factory=list)
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    log_args: list[str] = field(default_factory=list)  # --log-level/--log-format for every service


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
    parser.add_argument("--no-webui", dest="webui", action="store_false",
                        help="do not start the web UI (started by default, after the gateway)")
    parser.add_argument("--webui-port", type=int, default=7860,
                        help="port of the web UI (default: %(default)s)")
    parser.add_argument("--cluster-secret", default=None,
                        help="a shared secret for the controller, workers and gateway (registration, "
                             "heartbeats and every call between them carry it); passed to them in "
                             f"${SECRET_ENV}, never on a command line. Default: ${SECRET_ENV}")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        metavar="SECONDS",
                        help="on Ctrl-C/SIGTERM, how long every service may let in-flight requests "
                             "run before it exits (passed on as each one's --shutdown-timeout); "
                             "a service still running after that is killed (default: %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for each service (the first start converts the "
                             "default model once)")
    add_logging_flags(parser)  # serve's own, passed on to every service
    # flag > env > file > default: the file's top-level keys and [controller]/[api] ports are
    # this parser's file layer; its service tables become the services' flags (spec_from_args).
    return apply_env_defaults(parser, config_flag="--config", load_config=_serve_settings_from_file)


MANAGED_KEYS = frozenset({"host", "port", "controller_address", "worker_address"})
"""Service settings serve always passes on itself: their variables (LLMPLATFORM_PORT, ...) are
meant for a service run alone and never override a cluster file's value, nor serve's own."""


def _read_cluster_file(path: Path) -> dict:
    import tomllib

    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"error: cannot read {path}: {exc}") from exc


def _serve_settings_from_file(path: Path) -> dict:
    """The cluster file's settings for serve itself: top-level keys (`host`, `worker_port_base`,
    ...) and each service table's `port` as serve's `--<table>-port` (`[api] port = 8000`)."""
    data = _read_cluster_file(path)
    settings = {key: value for key, value in data.items() if not _is_table(value)}
    for table, value in data.items():
        if isinstance(value, dict) and "port" in value:
            settings[f"{table}_port"] = value["port"]
    return settings


def _is_table(value: object) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(v, dict) for v in value))


def service_flags(table: dict, parser: argparse.ArgumentParser, *, source: str,
                  environ: dict[str, str] | None = None) -> list[str]:
    """A service table of the cluster file as that service's flags, minus what the environment
    sets: the child inherits serve's environment, and env beats file (flag > env > file)."""
    env = os.environ if environ is None else environ

    def overridden(key: str) -> bool:
        action = find_action(parser, key)
        name = env_var_for(action) if action is not None else None
        if key in MANAGED_KEYS or name is None or not env.get(name, "").strip():
            return False
        logger.info("%s: %s from the file is overridden by $%s", source, key, name)
        return True

    return argv_from_mapping(parser, table, source=source, skip=overridden)


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    if not args.shutdown_timeout > 0:
        raise SystemExit("error: --shutdown-timeout must be > 0")
    spec = ClusterSpec(host=args.host, controller_port=args.controller_port,
                       api_port=args.api_port, worker_port_base=args.worker_port_base,
                       webui=args.webui, webui_port=args.webui_port,
                       shutdown_timeout=args.shutdown_timeout,
                       log_args=["--log-level", args.log_level, "--log-format", args.log_format])
    if args.config is not None:
        from llmplatform.controller.__main__ import build_parser as controller_parser
        from llmplatform.model_worker.__main__ import build_parser as worker_parser
        from llmplatform.openai_api.__main__ import build_parser as api_parser

        data = _read_cluster_file(args.config)
        # Ports (and the top-level keys) are already in args: file < env < flag.
        controller = {k: v for k, v in data.get("controller", {}).items() if k != "port"}
        api = {k: v for k, v in data.get("api", {}).items() if k != "port"}
        spec.controller_args = service_flags(controller, controller_parser(),
                                             source=f"{args.config} [controller]")
        spec.api_args = service_flags(api, api_parser(), source=f"{args.config} [api]")
        from llmplatform.webui.__main__ import build_parser as webui_parser

        webui = {k: v for k, v in data.get("webui", {}).items() if k != "port"}
        spec.webui_args = service_flags(webui, webui_parser(), source=f"{args.config} [webui]")
        workers = data.get("worker", data.get("workers", []))
        if not isinstance(workers, list) or not workers:
            raise SystemExit(f"error: {args.config} has no [[worker]] tables")
        spec.workers = [service_flags(dict(w), worker_parser(),
                                      source=f"{args.config} [[worker]] {i}")
                        for i, w in enumerate(workers)]
    if args.worker:
        spec.workers = ([] if args.config is None else spec.workers) + [shlex.split(w) for w in args.worker]
    # Keys that came from LLMPLATFORM_API_KEYS reach the gateway by inheritance (and stay out of
    # `ps`); only a flag's keys need passing on.
    if args.api_keys and args.api_keys != os.environ.get("LLMPLATFORM_API_KEYS", "").strip():
        spec.api_args += ["--api-keys", args.api_keys]
    return spec


def services_for(spec: ClusterSpec) -> list[ServiceSpec]:
    py = [sys.executable, "-m"]
    host = spec.host
    # Before each service's own flags, so that a per-service value (config file) wins.
    grace = ["--shutdown-timeout", f"{spec.shutdown_timeout:g}"] + spec.log_args
    reach = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    controller_url = f"http://{reach}:{spec.controller_port}"
    services = [ServiceSpec("controller",
                            py + ["llmplatform.controller", "--host", host,
                                  "--port", str(spec.controller_port)] + grace + spec.controller_args,
                            f"{controller_url}/health", controller_url)]
    next_port = spec.worker_port_base
    used_ports = {spec.controller_port, spec.api_port} | ({spec.webui_port} if spec.webui else set())
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
                                 "--controller-address", controller_url] + grace + extra + worker_args,
            f"{url}/health", url))
    api_url = f"http://{reach}:{spec.api_port}"
    services.append(ServiceSpec("api", py + ["llmplatform.openai_api", "--host", host,
                                             "--port", str(spec.api_port), "--controller-address",
                                             controller_url] + grace + spec.api_args,
                                f"{api_url}/health", api_url))
    if spec.webui:
        # Last: it needs the gateway. No --shutdown-timeout: a UI holds no work worth draining.
        webui_url = f"http://{reach}:{spec.webui_port}"
        services.append(ServiceSpec("webui", py + [
            "llmplatform.webui", "--host", host, "--port", str(spec.webui_port),
            "--api-base", f"{api_url}/v1", "--controller-address", controller_url,
        ] + spec.log_args + spec.webui_args, f"{webui_url}/health", webui_url))
    return services


def _gateway_key(spec: ClusterSpec) -> str | None:
    """One of the gateway's API keys (from its flags or LLMPLATFORM_API_KEYS), for the web UI."""
    args = spec.api_args
    keys = args[args.index("--api-keys") + 1] if "--api-keys" in args else os.environ.get(
        "LLMPLATFORM_API_KEYS", "")
    return next((k.strip() for k in keys.split(",") if k.strip()), None)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


class Cluster:
    def __init__(self, services: list[ServiceSpec], startup_timeout: float,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        self.services = services
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
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
        # All at once: each drains its own in-flight requests (the gateway's streams come from
        # workers that are draining too), so the whole cluster is down within one timeout.
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.shutdown_timeout + STOP_MARGIN_S
        for service, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", service.name)
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    secret = secret_from_env(args.cluster_secret)
    if secret is not None:
        # Children inherit the environment: the secret reaches every service without showing
        # in any process's command line (ps, /proc/PID/cmdline).
        os.environ[SECRET_ENV] = secret
    spec = spec_from_args(args)
    key = _gateway_key(spec) if spec.webui else None
    if key is not None and not os.environ.get("LLMPLATFORM_API_KEY"):
        os.environ["LLMPLATFORM_API_KEY"] = key  # the web UI's --api-key, kept out of `ps`
    cluster = Cluster(services_for(spec), args.startup_timeout, spec.shutdown_timeout)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT explicitly too: a shell starting us in the background leaves it ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        cluster.start()
        urls = {service.name: service.url for service in cluster.services}
        print(f"llmplatform serve: OpenAI API at {urls['api']}/v1  (Ctrl-C stops everything)",
              flush=True)
        if "webui" in urls:
            print(f"llmplatform serve: web UI at {urls['webui']}  (open it in a browser)",
                  flush=True)
        metrics = " ".join(f"{service.url}/metrics" for service in cluster.services
                           if "llmplatform.webui" not in service.argv)  # the UI has none
        print(f"llmplatform serve: Prometheus metrics at {metrics}", flush=True)
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
