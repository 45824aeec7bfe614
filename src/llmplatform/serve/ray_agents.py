"""The driver's side of ``serve --ray``'s host agents (``ray_agent.AgentActor``): one per Ray node
that may run workers, started once the controller is up, checked every ``CHECK_INTERVAL_S``.

Which nodes: with a loopback ``--host`` serve's node only (nothing elsewhere could reach a
worker); otherwise every live node, and a node that joins the cluster later gets its agent at the
next check. An agent that died (its process was killed) is replaced by a new actor on the same
port, so at the same address: the workers it ran went with it (Ray kills the actors an actor
owns), their placement groups are removed here (they belong to serve's job, not the agent),
and the controller, finding them no longer in that agent's listing, fails their models as when
a host agent restarts. When that port is taken meanwhile, the new agent takes a free one.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from llmplatform.serve.agent import AgentConfig
from llmplatform.serve.ray_launcher import forwarded_env
from llmplatform.serve.supervisor import STOP_MARGIN_S

CHECK_INTERVAL_S = 5.0
RETRY_AFTER_FAILURE_S = 30.0


@dataclass
class _Agent:
    actor: Any
    pending: Any
    """The answer awaited from it: its address (first its start, then each check's ping)."""
    url: str | None = None
    port: int = 0
    group_prefix: str = ""
    """The names of its workers' placement groups start with it (``remove_groups``)."""


class RayAgents:
    def __init__(self, config: AgentConfig, *, one_node: bool, startup_timeout_s: float) -> None:
        self.config = config
        self.one_node = one_node
        self.startup_timeout_s = startup_timeout_s
        self.agents: dict[str, _Agent] = {}  # by Ray node id
        self._retry_at: dict[str, float] = {}
        self._ports: dict[str, int] = {}
        """The port a node's dead agent had: its replacement's, once."""
        self._next_check = 0.0

    def _nodes(self) -> list[str]:
        import ray

        if self.one_node:
            return [ray.get_runtime_context().get_node_id()]
        return [n["NodeID"] for n in ray.nodes() if n["Alive"]]

    def _start(self, node_id: str, port: int = 0) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from llmplatform.serve.ray_agent import AgentActor

        # No CPU of its own (it mostly waits), and pinned: an agent speaks for its node only.
        group_prefix = f"llmplatform-agent-{uuid.uuid4().hex[:12]}-"
        actor = ray.remote(AgentActor).options(
            num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(self.config, forwarded_env(), port, group_prefix)
        self.agents[node_id] = _Agent(actor, actor.address.remote(), port=port,
                                      group_prefix=group_prefix)

    def start(self) -> None:
        """An agent on each node now, waiting until each registered with the controller (so a
        launch right after serve's announcement finds them)."""
        import ray

        for node_id in self._nodes():
            self._start(node_id)
        for node_id, agent in self.agents.items():
            try:
                agent.url, host_name = ray.get(agent.pending, timeout=self.startup_timeout_s)
            except ray.exceptions.RayActorError as exc:
                raise RuntimeError(f"the host agent on Ray node {node_id} could not start: "
                                   f"{exc}") from None
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"the host agent on Ray node {node_id} did not start within "
                                   f"{self.startup_timeout_s:.0f} s") from None
            agent.pending = None
            print(f"llmplatform serve: host agent for {host_name} ready at {agent.url} (Ray "
                  "actor)", flush=True)
        self._next_check = time.monotonic() + CHECK_INTERVAL_S

    def check(self) -> None:
        """Every CHECK_INTERVAL_S (called from the deployment's watch loop): replace dead agents,
        start one on each new node."""
        import ray

        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        for node_id, agent in list(self.agents.items()):
            if agent.pending is None:
                agent.pending = agent.actor.address.remote()
                continue
            ready, _ = ray.wait([agent.pending], timeout=0)
            if not ready:
                continue  # starting, or busy stopping its workers
            try:
                url, host_name = ray.get(agent.pending)
            except ray.exceptions.RayActorError as exc:
                del self.agents[node_id]
                remove_groups(agent.group_prefix)  # its workers' CPUs and GPUs, free again
                # Died: again at once, at its address. Could not start there: at once, on any
                # port. Could not start at all: later.
                again_now = agent.url is not None or agent.port != 0
                self._retry_at[node_id] = now + (0 if again_now else RETRY_AFTER_FAILURE_S)
                if agent.url is not None:
                    self._ports[node_id] = int(agent.url.rsplit(":", 1)[1])
                why = (str(exc).strip().splitlines() or [""])[0]
                print(f"llmplatform serve: error: the host agent on Ray node {node_id} "
                      f"{'died' if agent.url else 'could not start'}: {why}", file=sys.stderr,
                      flush=True)
                continue
            if agent.url is None:
                print(f"llmplatform serve: host agent for {host_name} ready at {url} (Ray "
                      "actor)", flush=True)
            agent.url, agent.pending = url, agent.actor.address.remote()
        for node_id in self._nodes():
            if node_id not in self.agents and now >= self._retry_at.get(node_id, 0):
                self._start(node_id, self._ports.pop(node_id, 0))

    def stopping(self) -> list[Any]:
        """Ask every agent to drain its workers; the answers to wait for."""
        return [agent.actor.stop.remote() for agent in self.agents.values()]

    def kill(self) -> None:
        import ray

        for agent in self.agents.values():
            ray.kill(agent.actor, no_restart=True)  # its worker actors go with it

    def stop_timeout_s(self) -> float:
        return self.config.worker_shutdown_timeout + 2 * STOP_MARGIN_S


def remove_groups(prefix: str) -> None:
    """Removes the placement groups whose names start with ``prefix``: a dead agent's. Its
    worker actors died with it, but the groups it made belong to serve's job and would hold
    their CPUs and GPUs until serve exits."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    for info in ray.util.placement_group_table().values():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(info["name"]))
            except ValueError:  # removed meanwhile
                pass
