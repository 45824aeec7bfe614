"""``serve --ray``'s host agents: the agent of ``agent.py`` (same routes, same checks, same
registration with the cluster secret) run as a Ray actor pinned to its node, one per node
(``ray_agents.py`` places them). Its workers are Ray actors too, not its own children.

Why actors for the workers: each one reserves its CPUs and GPUs from Ray like the workers serve
starts (``ray_launcher.worker_resources``), so Ray's accounting (``ray status``, and what other
actors can still get) includes them, a GPU worker runs on the GPU Ray hands it (Ray sets its
CUDA_VISIBLE_DEVICES), and cleanup is Ray's: a worker actor is owned by its agent actor, so when
the agent dies (killed, its node lost) Ray kills the worker actors, and each worker process gets
SIGTERM from its actor's death (parent-death signal) and drains. A worker process owned by the
agent directly would be invisible to Ray's scheduler, which could then hand its CPUs or GPU to
something else.

Before a launch is answered, each worker's CPUs and GPUs are reserved on the agent's node (a
placement group of one bundle, selecting the node by its ``ray.io/node-id`` label: milliseconds
when they are free). When Ray cannot reserve them within ``PLACEMENT_TIMEOUT_S`` (other actors
hold them) the launch is refused with a 409 like one that does not fit in memory, nothing is
started, and the controller may try another node's agent. The worker actors then start in their
reservations in the background (a listed worker's `pid` is 0 until its process runs). The
memory check is the host agent's (``launch_checks``: the node's available memory, or its first
GPU's free memory, within ``--agent-memory-limit``), run on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplatform.protocol.lifecycle import (
    AgentProcess,
    LaunchModelRequest,
    LaunchWorkersRequest,
    ProcessState,
)
from llmplatform.serve.agent import AgentConfig, start_agent
from llmplatform.serve.agent_processes import WorkerCommand, exit_reason, free_port
from llmplatform.serve.launch_checks import LaunchRefused
from llmplatform.serve.ray_launcher import forwarded_env, worker_resources
from llmplatform.serve.ray_local import LOOPBACK_HOSTS, WILDCARD_HOSTS
from llmplatform.serve.supervisor import STOP_MARGIN_S
from llmplatform.utils.cluster_secret import SECRET_ENV

logger = logging.getLogger("llmplatform.serve.agent")

PLACEMENT_TIMEOUT_S = 3.0
"""How long a launch waits for Ray to reserve its workers' CPUs and GPUs on the node (a
placement group: milliseconds when they are free); the answer must reach the gateway, which waits
10 s for the controller."""
NODE_LABEL = "ray.io/node-id"
"""The label Ray gives every node: a placement group's bundle selects its node by it."""
STATE_WAIT_S = 1.0
STATE_TIMEOUT_S = 10.0
STOP_POLL_S = 0.2


class WorkerActor:
    """One launched worker: its process is this actor's child. The actor outlives the process
    (an exited worker's reason stays readable) until its agent kills it."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        from llmplatform.serve.supervisor import die_with_parent

        self.log_path = Path(log_path)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def state(self) -> tuple[int, int | None, str | None]:
        """Its process id, exit status (None while it runs) and, once exited, why."""
        code = self.proc.poll()
        return self.proc.pid, code, None if code is None else exit_reason(code, self.log_path)

    def terminate(self) -> None:
        """SIGTERM: the worker deregisters and drains within its --shutdown-timeout."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _RayWorker:
    address: str
    model_name: str
    actor: Any
    group: Any
    """Its placement group: the CPUs and GPUs reserved for it on the agent's node."""
    reserved_bytes: int
    spec: LaunchModelRequest | None
    pid: int = 0
    """0 until its actor has started the process."""
    asked: Any = None
    """Its actor's answer to `state` being awaited."""
    final: AgentProcess | None = None
    """Its description once exited (it cannot change any more)."""


class RayWorkers:
    """An agent's workers as Ray actors on its node (``agent.Workers``)."""

    def __init__(self, command: WorkerCommand, *, node_id: str, node_cpus: float,
                 node_gpus: float, group_prefix: str = "",
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        import ray

        self._command = command
        # Each placement group is named with it: if the agent dies, serve removes its groups
        # (a group outlives the actor that made it; its lifetime is serve's job).
        self._group_prefix = group_prefix
        self._node_id = node_id
        self._node_cpus = node_cpus
        self._node_gpus = node_gpus
        self._placement_timeout = placement_timeout_s
        self._remote = ray.remote(WorkerActor)
        self._workers: dict[str, _RayWorker] = {}

    def _describe(self, workers: list[_RayWorker]) -> list[AgentProcess]:
        """Each worker as its actor says, asked all at once; one still starting (or too busy
        to answer within STATE_WAIT_S) is running as last known."""
        import ray

        for worker in workers:
            if worker.final is None and worker.asked is None:
                worker.asked = worker.actor.state.remote()
        asked = [w.asked for w in workers if w.final is None and w.asked is not None]
        ready = set(ray.wait(asked, num_returns=len(asked), timeout=STATE_WAIT_S)[0]) if asked \
            else set()
        described = []
        for worker in workers:
            if worker.final is not None:
                described.append(worker.final)
                continue
            code, reason = None, None
            if worker.asked in ready:
                ref, worker.asked = worker.asked, None
                try:
                    worker.pid, code, reason = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    first_line = (str(exc).strip().splitlines() or [""])[0]
                    code, reason = -1, f"worker exited: its Ray actor died: {first_line}"
            running = code is None
            process = AgentProcess(
                worker_address=worker.address, model_name=worker.model_name, pid=worker.pid,
                state=ProcessState.RUNNING if running else ProcessState.EXITED,
                exit_reason=reason, reserved_bytes=worker.reserved_bytes if running else 0,
                spec=worker.spec)
            if not running:
                worker.final = process
            described.append(process)
        return described

    def reserved_bytes(self) -> int:
        return sum(p.reserved_bytes for p in self.listing())

    def listing(self) -> list[AgentProcess]:
        return self._describe(list(self._workers.values()))

    def knows(self, address: str) -> bool:
        return address in self._workers

    async def launch(self, request: LaunchWorkersRequest,
                     per_worker_bytes: int) -> list[AgentProcess]:
        """Reserve each worker's CPUs and GPUs on this node (all or none: 409 when Ray cannot),
        then start the worker actors there; they start their processes in the background."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cpus, gpus = worker_resources(request.worker_args, has_gpus=self._node_gpus > 0)
        if cpus > self._node_cpus or gpus > self._node_gpus:
            raise LaunchRefused(f"a worker of {request.model_name!r} needs {cpus} CPU(s) and "
                                f"{gpus} GPU(s) from Ray; this node has {self._node_cpus:g} and "
                                f"{self._node_gpus:g}", 409)
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        groups = [placement_group([bundle], bundle_label_selector=[{NODE_LABEL: self._node_id}],
                                  name=f"{self._group_prefix}{uuid.uuid4().hex}")
                  for _ in range(request.replicas)]
        refs = [group.ready() for group in groups]
        ready, _ = await asyncio.to_thread(ray.wait, refs, num_returns=len(refs),
                                           timeout=self._placement_timeout)
        if len(ready) < len(refs):
            self._release([], groups)
            raise LaunchRefused(
                f"{request.replicas} worker(s) of {request.model_name!r} need {cpus} CPU(s) and "
                f"{gpus} GPU(s) each from Ray on this node, which other actors hold (`ray "
                f"status`); Ray could not place them within {self._placement_timeout:g} s", 409)
        env = {**forwarded_env(), **self._secret_env()}
        started: list[_RayWorker] = []
        try:
            for group in groups:
                port = free_port(self._command.host)
                argv, address = self._command.argv(request, port)
                log_path = self._command.log_path(request, port)
                actor = self._remote.options(
                    num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
                ).remote(argv, env, str(log_path))
                started.append(_RayWorker(address, request.model_name, actor, group,
                                          per_worker_bytes, request.spec))
        except OSError as exc:  # no log folder
            self._release([w.actor for w in started], groups)
            raise LaunchRefused(f"the workers could not be started: {exc}", 503) from None
        for worker in started:
            self._workers[worker.address] = worker
            logger.info("starting worker %s for %s as a Ray actor", worker.address,
                        worker.model_name)
        return await asyncio.to_thread(self._describe, started)

    def _secret_env(self) -> dict[str, str]:
        secret = self._command.cluster_secret
        return {} if secret is None else {SECRET_ENV: secret}  # never on the command line

    @staticmethod
    def _release(actors: list[Any], groups: list[Any]) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in actors:
            ray.kill(actor, no_restart=True)  # its process gets SIGTERM as it dies
        for group in groups:
            remove_placement_group(group)

    async def stop(self, address: str) -> AgentProcess:
        """SIGTERM the worker, wait until it exited (drained, or killed after its grace), then
        end its actor and give its CPUs and GPUs back to Ray. Returns its last description."""
        import ray

        worker = self._workers[address]
        deadline = time.monotonic() + self._command.shutdown_timeout + STOP_MARGIN_S
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            await asyncio.to_thread(ray.get, worker.actor.terminate.remote(),
                                    timeout=STATE_TIMEOUT_S)
            logger.info("stopping worker %s (pid %d)", address, worker.pid)
        [described] = await asyncio.to_thread(self._describe, [worker])
        while described.state is ProcessState.RUNNING and time.monotonic() < deadline:
            await asyncio.sleep(STOP_POLL_S)
            [described] = await asyncio.to_thread(self._describe, [worker])
        if described.state is ProcessState.RUNNING:
            logger.warning("worker %s did not stop in time; killing it", address)
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                await asyncio.to_thread(ray.get, worker.actor.kill.remote(), timeout=STATE_TIMEOUT_S)
            [described] = await asyncio.to_thread(self._describe, [worker])
        await asyncio.to_thread(self._release, [worker.actor], [worker.group])
        self._workers.pop(address, None)
        return described

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(address) for address in list(self._workers)))


class AgentActor:
    """One node's agent: the agent app served from this actor (on a thread), its workers Ray
    actors on this node (``RayWorkers``), registered with the controller as any agent is."""

    def __init__(self, config: AgentConfig, env: dict[str, str], port: int,
                 group_prefix: str = "") -> None:
        import ray

        os.environ.update(env)  # serve's LLMPLATFORM_* variables, as its services get them
        node_ip = ray.util.get_node_ip_address()
        node_id = ray.get_runtime_context().get_node_id()
        # Loopback stays loopback (every actor is on serve's node); the wildcard binds the
        # wildcard and announces the node's IP; any other --host is serve's node's: bind here.
        host = config.host if config.host in LOOPBACK_HOSTS + WILDCARD_HOSTS else node_ip
        reach = node_ip if host in WILDCARD_HOSTS else host
        self.config = dataclasses.replace(config, host=host, host_name=socket.gethostname())
        resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id), {})
        command = WorkerCommand(
            host=host, reach=reach, controller_address=config.controller_address,
            cluster_secret=config.cluster_secret, log_dir=config.log_dir,
            shutdown_timeout=config.worker_shutdown_timeout, log_args=tuple(config.log_args))
        self.workers = RayWorkers(command, node_id=node_id,
                                  node_cpus=resources.get("CPU", 0),
                                  node_gpus=resources.get("GPU", 0), group_prefix=group_prefix)
        self.stack = contextlib.ExitStack()
        try:
            _, self.url = start_agent(self.stack, self.config, port, self.workers,
                                      advertise_host=reach if host in WILDCARD_HOSTS else None)
        except BaseException:
            self.stack.close()
            raise

    def address(self) -> tuple[str, str]:
        """Where the controller reaches it, and its host name."""
        return self.url, self.config.host_name

    def stop(self) -> None:
        """Drain every worker (all at once, each within its shutdown timeout), then stop serving."""
        asyncio.run(self.workers.stop_all())
        self.stack.close()
