"""`python -m llmplatform.serve.agent_main`: one host's agent (``agent.py``); `llmplatform serve`
starts one beside its controller, and a multi-host deployment runs one more per host."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

from llmplatform.serve.agent import AgentConfig, create_app
from llmplatform.utils.cluster_secret import secret_from_env
from llmplatform.utils.logs import configure_logging
from llmplatform.utils.service_settings import ServerSettings
from llmplatform.utils.settings import OptionalText, option
from llmplatform.utils.sizes import parse_size

DEFAULT_PORT = 21100


class AgentServiceSettings(ServerSettings):
    cli_prog = "python -m llmplatform.serve.agent_main"
    cli_description = ("Run a host agent: starts and stops model workers on this host when the "
                       "controller asks (POST /v1/admin/models on the gateway).")

    port: int = option(DEFAULT_PORT, "bind port (default: %(default)s)")
    controller_address: str = option("http://127.0.0.1:21001", "the controller's URL "
                                     "(default: %(default)s)")
    agent_address: OptionalText = option(
        None, "URL the controller reaches this agent at (default: http://HOST:PORT; required "
        "when binding 0.0.0.0)")
    host_name: str = option(socket.gethostname(), "the name launches place workers by "
                            "(their `host` field) (default: this machine's host name)")
    memory_limit: OptionalText = option(
        None, "most memory its workers may be admitted with together (weights + KV pools), e.g. "
        "48GiB (default: whatever the host has free)")
    log_dir: Path = option(Path("/tmp/llmplatform-agent"), "each worker's output goes to "
                           "LOG_DIR/worker-<model>-<port>.log (default: %(default)s)")
    worker_shutdown_timeout: float = option(
        30.0, "a stopped worker's grace for its in-flight requests (its --shutdown-timeout) "
        "(default: %(default)s)", metavar="SECONDS", gt=0)


def main(argv: Sequence[str] | None = None) -> None:
    settings = AgentServiceSettings.parse(argv)
    configure_logging(settings.log_level, settings.log_format)
    host = settings.host
    if settings.agent_address is None and host in ("0.0.0.0", "::"):
        raise SystemExit("error: --agent-address is required when binding a wildcard address")
    secret = secret_from_env(settings.cluster_secret)
    if secret is None and host not in ("127.0.0.1", "localhost", "::1"):
        # Whoever reaches it could start processes of their choosing on this host.
        raise SystemExit("error: an agent reachable from other hosts needs the cluster secret "
                         "($LLMPLATFORM_CLUSTER_SECRET, as the controller has it)")
    config = AgentConfig(
        controller_address=settings.controller_address.rstrip("/"),
        agent_address=(settings.agent_address or f"http://{host}:{settings.port}").rstrip("/"),
        host=host, host_name=settings.host_name,
        cluster_secret=secret,
        memory_limit_bytes=None if settings.memory_limit is None else parse_size(settings.memory_limit),
        log_dir=settings.log_dir, worker_shutdown_timeout=settings.worker_shutdown_timeout,
        log_args=("--log-level", settings.log_level, "--log-format", settings.log_format))
    settings.run(create_app(config))


if __name__ == "__main__":
    main()
