"""``llmplatform serve --ray [ADDRESS]``: serve's services placed as Ray actors.

One configuration, two launchers: the services are the very ``ServiceSpec`` list the local
launcher builds (``launcher.services_for``: same flags, same cluster file, secrets in each
service's environment, never its argv). Here each one becomes a ``ServiceActor`` that runs the
service's command line as its child process; Ray places the actor (``num_cpus``/``num_gpus``),
restarts it when it dies (``max_restarts=-1``), and the restarted service registers with the
controller by itself, exactly as under the local supervisor. The actor exits when its child
exits, so a crashed service is a dead actor that Ray restarts; the child dies with its actor
(parent-death signal), so a killed actor leaves no orphan.

Placement. The controller, the gateway and the web UI stay on the node that runs ``serve`` (their
addresses are what serve prints and what the workers are told). Workers go wherever Ray finds
their resources when ``--host`` is not loopback; each binds on its node and gives the controller
its node's address (Ray's node IP). With a loopback ``--host`` (the default) nothing else could
reach them, so every actor stays on serve's node. A worker with ``--tensor-parallel-size N``
runs its N ranks as its own child processes, so its actor reserves N CPUs (and N GPUs on CUDA):
one actor's resources always come from one node, which packs the ranks there and makes all N
GPUs visible to the worker (a placement group of one bundle per rank would hand the worker's
process one bundle's GPU only).

Models launched at runtime (``POST /v1/admin/models``): instead of serve's own host agent, each
node that may run workers gets one as a Ray actor (``ray_agents``, ``ray_agent``), whose workers
are Ray actors on its node.

Ray itself: bare ``--ray`` starts a local Ray instance for this run (``ray_local``: its files in a
0700 folder of ours, its own 0600 token, its ports on loopback with a loopback ``--host``, bounded
object store, no dashboard) and shuts it down at exit; ``--ray auto`` or ``--ray HOST:PORT`` joins a running
cluster (``ray start --head``) and leaves it running. Ctrl-C stops every service (each with its
shutdown timeout), kills every actor and disconnects.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from llmplatform.serve.ray_local import LOOPBACK_HOSTS, WILDCARD_HOSTS, LocalRay, tighten_token_file
from llmplatform.serve.supervisor import STOP_MARGIN_S, ServiceSpec, run_until_stopped

if TYPE_CHECKING:
    from llmplatform.serve.agent import AgentConfig

logger = logging.getLogger("llmplatform.serve")

LOCAL = "local"
"""What bare ``--ray`` means: start a Ray instance on this machine for this run only."""
MISSING_RAY = ("error: `serve --ray` needs Ray, an optional extra: "
               "pip install 'llmplatform[ray]'")
POLL_INTERVAL_S = 1.0
FORWARDED_ENV_PREFIX = "LLMPLATFORM_"


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in argv, as ``flag value`` or ``flag=value`` (argparse's
    winner), None when absent."""
    for i in range(len(argv) - 1, -1, -1):
        if argv[i].startswith(flag + "="):
            return argv[i].partition("=")[2]
        if argv[i] == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with the value of every ``flag`` replaced (appended when absent)."""
    out = list(argv)
    found = False
    for i in range(len(out) - 1):
        if out[i] == flag:
            out[i + 1], found = value, True
    return out if found else out + [flag, value]


@dataclass(frozen=True)
class Placement:
    """Where one service's actor runs and what it binds: computed by the driver, applied by the
    actor on the node it lands on (again after a restart, which may land elsewhere)."""

    num_cpus: float
    num_gpus: float
    pin_to_driver_node: bool
    bind_node_ip: bool
    """Bind on the actor's node (its IP, or the wildcard --host) and advertise the node's IP."""
    advertise_worker_address: bool
    """serve chose --worker-address (not the user): rewrite it to the node's address."""


def worker_resources(argv: list[str], *, has_gpus: bool) -> tuple[int, int]:
    """The CPUs and GPUs a worker's actor reserves: one CPU per rank (tensor-parallel times
    pipeline ranks), and a GPU per rank when its --device is cuda, or auto where there are GPUs
    (its flags, else the forwarded LLMPLATFORM_* variables)."""
    device = _flag_value(argv, "--device") or os.environ.get(
        FORWARDED_ENV_PREFIX + "DEVICE", "auto")
    gpus = 1 if device == "cuda" or (device == "auto" and has_gpus) else 0
    ranks = int(_flag_value(argv, "--tensor-parallel-size") or os.environ.get(
        FORWARDED_ENV_PREFIX + "TENSOR_PARALLEL_SIZE", "1")) * int(
        _flag_value(argv, "--pipeline-parallel-size") or os.environ.get(
            FORWARDED_ENV_PREFIX + "PIPELINE_PARALLEL_SIZE", "1"))
    return ranks, gpus * ranks


def forwarded_env() -> dict[str, str]:
    """The LLMPLATFORM_* variables set where serve runs: every service gets them, on any node."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIX)}


def placements(services: list[ServiceSpec], *, host: str, user_worker_addresses: list[bool],
               cluster_has_gpus: bool) -> list[Placement]:
    one_host = host in LOOPBACK_HOSTS
    result, worker_index = [], 0
    for service in services:
        if not service.name.startswith("worker"):
            result.append(Placement(0, 0, True, False, False))
            continue
        cpus, gpus = worker_resources(service.argv, has_gpus=cluster_has_gpus)
        result.append(Placement(cpus, gpus, one_host, not one_host,
                                not user_worker_addresses[worker_index]))
        worker_index += 1
    return result


def controller_for_workers(url: str, *, host: str, driver_ip: str) -> str:
    """Bound to the wildcard, serve tells its services the controller is at 127.0.0.1: true on
    serve's node only. What runs elsewhere (a worker, a node's agent) is told serve's node IP."""
    if host in WILDCARD_HOSTS and "//127.0.0.1:" in url:
        return url.replace("//127.0.0.1:", f"//{driver_ip}:", 1)
    return url


def workers_reach_controller(services: list[ServiceSpec], *, host: str, driver_ip: str) -> None:
    """Each worker's --controller-address as it reaches the controller from any node."""
    for service in services:
        url = _flag_value(service.argv, "--controller-address")
        if service.name.startswith("worker") and url:
            service.argv = _set_flag(service.argv, "--controller-address",
                                     controller_for_workers(url, host=host, driver_ip=driver_ip))


def on_node(service: ServiceSpec, placement: Placement, node_ip: str) -> tuple[list[str], str]:
    """The service's argv as it runs on a node with IP ``node_ip``, and the URL that answers its
    health there. Workers leave serve's node: they bind there and advertise its address."""
    argv = [sys.executable] + service.argv[1:]  # this node's interpreter
    port = service.url.rsplit(":", 1)[1]
    if not placement.bind_node_ip:
        return argv, service.health_url
    host = _flag_value(argv, "--host") or ""
    if host not in WILDCARD_HOSTS:
        argv = _set_flag(argv, "--host", node_ip)
    if placement.advertise_worker_address:
        argv = _set_flag(argv, "--worker-address", f"http://{node_ip}:{port}")
    return argv, f"http://{node_ip}:{port}/health"


class ServiceActor:
    """One service as a Ray actor: its process is the actor's child and lives as long as it."""

    def __init__(self, service: ServiceSpec, placement: Placement, env: dict[str, str],
                 startup_timeout_s: float, shutdown_timeout_s: float,
                 log_dir: str | None) -> None:
        import ray

        self.name = service.name
        self.incarnation = uuid.uuid4().hex  # the driver counts restarts by it changing
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stopping = False
        argv, health_url = on_node(service, placement, ray.util.get_node_ip_address())
        _wait_port_free(health_url, shutdown_timeout_s + STOP_MARGIN_S)
        output = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            output = open(Path(log_dir) / (service.name.replace(" ", "-") + ".log"), "ab")  # noqa: SIM115
        from llmplatform.serve.supervisor import die_with_parent

        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=output,
                                     stderr=subprocess.STDOUT if output else None,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(health_url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} during "
                                   "startup (its output is above, or in --log-dir)")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"{self.name} did not become healthy within "
                                   f"{startup_timeout_s:.0f} s")
            time.sleep(0.3)
        threading.Thread(target=self._exit_with_child, daemon=True).start()

    def _exit_with_child(self) -> None:
        code = self.proc.wait()
        if not self.stopping:
            # A dead service must be a dead actor, or Ray would never restart it.
            print(f"llmplatform serve: {self.name} (pid {self.proc.pid}) exited unexpectedly "
                  f"(code {code}); Ray restarts it", file=sys.stderr, flush=True)
            os._exit(1)

    def get_incarnation(self) -> str:
        return self.incarnation

    def child_pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int | None:
        """SIGTERM the service, let it drain for its shutdown timeout, then kill it."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.shutdown_timeout_s + STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_port_free(health_url: str, timeout_s: float) -> None:
    """A restarted actor's new service needs the port its killed predecessor may still hold while
    it drains (the parent-death signal is SIGTERM: in-flight requests may finish)."""
    host_port = health_url.split("//", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind((host.strip("[]"), int(port)))
                return
            except OSError:
                time.sleep(0.3)


def run_on_ray(address: str, services: list[ServiceSpec], settings: Any,
               user_worker_addresses: list[bool], agent_config: AgentConfig) -> int:
    """serve's main under --ray: connect (or start Ray), deploy, print, run, tear down."""
    # Not imported yet: Ray reads some of what LocalRay sets in the environment at import.
    if importlib.util.find_spec("ray") is None:
        raise SystemExit(MISSING_RAY)
    local = LocalRay(settings.host) if address == LOCAL else None
    if local is not None:
        num_workers = sum(s.name.startswith("worker") for s in services)
        try:
            local.start(num_cpus=max(os.cpu_count() or 1, num_workers))
        except BaseException:
            local.close()
            raise
    import ray

    if local is None:
        tighten_token_file()
        try:
            ray.init(address=address)
        except (ConnectionError, RuntimeError) as exc:
            raise SystemExit(f"error: cannot join the Ray cluster at {address!r}: {exc} (is it "
                             "started, `ray start --head`? with token authentication, the "
                             "driver needs RAY_AUTH_MODE=token and the cluster's token; see "
                             "docs/multihost.md)") from None
    from llmplatform.serve.down_report import DownReporter
    from llmplatform.serve.launcher import print_addresses, restart_policy
    from llmplatform.serve.ray_agents import RayAgents
    from llmplatform.serve.ray_deployment import RayDeployment
    from llmplatform.utils.cluster_secret import SECRET_ENV

    controller = next(s for s in services if s.name == "controller")
    driver_ip = ray.util.get_node_ip_address()
    workers_reach_controller(services, host=settings.host, driver_ip=driver_ip)
    agents = RayAgents(
        dataclasses.replace(agent_config, controller_address=controller_for_workers(
            agent_config.controller_address, host=settings.host, driver_ip=driver_ip)),
        one_node=settings.host in LOOPBACK_HOSTS, startup_timeout_s=settings.startup_timeout)
    deployment = RayDeployment(
        services, placements(services, host=settings.host,
                             user_worker_addresses=user_worker_addresses,
                             cluster_has_gpus=ray.cluster_resources().get("GPU", 0) > 0),
        agents,
        startup_timeout_s=settings.startup_timeout, shutdown_timeout_s=settings.shutdown_timeout,
        policy=restart_policy(settings), log_dir=settings.log_dir,
        on_state=DownReporter(controller.url, controller.env.get(SECRET_ENV)))

    def started() -> None:
        if local is not None:
            local.tighten()  # the folders Ray made for the actors' workers
        print_addresses(services, "Ray actors; Ctrl-C stops everything")

    try:
        return run_until_stopped(deployment, started)
    finally:
        ray.shutdown()  # stops the local instance we started; only disconnects otherwise
        if local is not None:
            local.close()
