"""``llmplatform serve``: a controller, one or more model workers and the gateway, one command.

Each service runs in its own process (as in a real deployment, and so one model's crash cannot
take the others down). This module turns serve's flags and cluster file into each service's
command line and environment; ``supervisor.py`` runs them: starts them in dependency order,
restarts one that dies (with backoff, a bounded number of times a minute) and on Ctrl-C/SIGTERM
stops them all, each with its `--shutdown-timeout` to finish in-flight requests.

Registration is closed by default: without a cluster secret (flag, variable or cluster file),
serve makes a random one for the run. Secrets (that one, API keys, any secret flag of a
service) reach the services in their environment, never on a command line (``secret_flags.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from llmplatform.serve.secret_flags import move_secrets_to_env, redacted
from llmplatform.serve.supervisor import RestartPolicy, ServiceSpec, Supervisor
from llmplatform.utils.cli import apply_env_defaults, argv_from_mapping, env_var_for, find_action
from llmplatform.utils.cluster_secret import SECRET_ENV, secret_from_env
from llmplatform.utils.logs import add_logging_flags, configure_logging

logger = logging.getLogger("llmplatform.serve")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""Passed on to every service as its --shutdown-timeout (in-flight requests' grace period)."""
API_KEYS_ENV = "LLMPLATFORM_API_KEYS"
WEBUI_KEY_ENV = "LLMPLATFORM_API_KEY"


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
    cluster_secret: str | None = None  # handed to every service in $LLMPLATFORM_CLUSTER_SECRET


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
                        help="a shared secret for the controller, workers, gateway and web UI "
                             "(registration, heartbeats and every call between them carry it); "
                             f"passed to them in ${SECRET_ENV}, never on a command line. Default: "
                             f"${SECRET_ENV}, else the file's cluster_secret, else a random one "
                             "made for this run and shown nowhere (registration stays closed; "
                             "give one to add workers started elsewhere or to call the "
                             "controller yourself)")
    parser.add_argument("--max-restarts-per-minute", type=int, default=5, metavar="N",
                        help="a service that exits while serve runs is restarted after a backoff "
                             "(1 s, doubling up to 30 s); one that exits more than N times within "
                             "a minute stops everything, and serve exits non-zero. 0: stop "
                             "everything at the first exit (default: %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="write each service's output to LOG_DIR/<service>.log (appended "
                             "across restarts) instead of serve's own stderr")
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
    if args.max_restarts_per_minute < 0:
        raise SystemExit("error: --max-restarts-per-minute must be >= 0")
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
        _refuse_per_service_secret(data, args.config)
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
    # Keys that came from LLMPLATFORM_API_KEYS reach the gateway by inheritance; a flag's (or
    # the file's top-level api_keys) are passed on, and services_for moves them into the
    # gateway's environment like every secret flag.
    if args.api_keys and args.api_keys != os.environ.get(API_KEYS_ENV, "").strip():
        spec.api_args += ["--api-keys", args.api_keys]
    return spec


def _refuse_per_service_secret(data: dict, path: Path) -> None:
    """One cluster, one secret: a service table's own cluster_secret would lock the others out."""
    for table, value in data.items():
        tables = value if isinstance(value, list) else [value]
        if any(isinstance(t, dict) and "cluster_secret" in t for t in tables):
            raise SystemExit(f"error: {path} [{table}]: cluster_secret is shared by every "
                             "service; set it once at the top of the file")


def _command_lines(spec: ClusterSpec) -> list[ServiceSpec]:
    """Every service with its full command line, secrets still in it (see services_for)."""
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



def _service_parsers() -> dict[str, argparse.ArgumentParser]:
    from llmplatform.controller.__main__ import build_parser as controller_parser
    from llmplatform.model_worker.__main__ import build_parser as worker_parser
    from llmplatform.openai_api.__main__ import build_parser as api_parser
    from llmplatform.webui.__main__ import build_parser as webui_parser

    return {"llmplatform.controller": controller_parser(),
            "llmplatform.model_worker": worker_parser(),
            "llmplatform.openai_api": api_parser(), "llmplatform.webui": webui_parser()}


def services_for(spec: ClusterSpec) -> list[ServiceSpec]:
    """Every service serve starts: its command line (no secret in it), the variables that carry
    its secrets instead, and the line serve prints for it (any secret left shown as ***)."""
    parsers = _service_parsers()
    services = _command_lines(spec)
    for service in services:
        parser = parsers[service.argv[service.argv.index("-m") + 1]]
        service.argv, service.env = move_secrets_to_env(service.argv, parser)
        if spec.cluster_secret is not None:
            service.env.setdefault(SECRET_ENV, spec.cluster_secret)
        service.shown_argv = redacted(service.argv, parser)
    api = next(s for s in services if s.name == "api")
    webui = next((s for s in services if s.name == "webui"), None)
    key = _gateway_key(api)
    if webui is not None and key is not None and WEBUI_KEY_ENV not in webui.env \
            and not os.environ.get(WEBUI_KEY_ENV, "").strip():
        webui.env[WEBUI_KEY_ENV] = key  # the web UI's --api-key: one of the gateway's keys
    return services


def _gateway_key(api: ServiceSpec) -> str | None:
    """One of the gateway's API keys (from serve's flags, the file or LLMPLATFORM_API_KEYS)."""
    keys = api.env.get(API_KEYS_ENV) or os.environ.get(API_KEYS_ENV, "")
    return next((k.strip() for k in keys.split(",") if k.strip()), None)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    spec = spec_from_args(args)
    spec.cluster_secret = secret_from_env(args.cluster_secret)
    if spec.cluster_secret is None:
        # Closed by default: without a secret anyone who can reach the controller could register
        # a worker and receive prompts. The secret is shown nowhere; it lives in the services'
        # environment only.
        spec.cluster_secret = secrets.token_urlsafe(32)
        logger.info("made a random cluster secret for this run (registration is closed; give "
                    "--cluster-secret or $%s to add workers started elsewhere)", SECRET_ENV)
    services = services_for(spec)
    supervisor = Supervisor(services, startup_timeout=args.startup_timeout,
                            shutdown_timeout=spec.shutdown_timeout,
                            policy=RestartPolicy(max_restarts_per_minute=args.max_restarts_per_minute),
                            log_dir=args.log_dir)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT explicitly too: a shell starting us in the background leaves it ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        supervisor.start()
        urls = {service.name: service.url for service in services}
        print(f"llmplatform serve: OpenAI API at {urls['api']}/v1  (Ctrl-C stops everything)",
              flush=True)
        if "webui" in urls:
            print(f"llmplatform serve: web UI at {urls['webui']}  (open it in a browser)",
                  flush=True)
        metrics = " ".join(f"{url}/metrics" for name, url in urls.items()
                           if name != "webui")  # the UI has none
        print(f"llmplatform serve: Prometheus metrics at {metrics}", flush=True)
        code = supervisor.run()
    except KeyboardInterrupt:
        print("llmplatform serve: stopping", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"llmplatform serve: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        supervisor.stop()
    raise SystemExit(code)
