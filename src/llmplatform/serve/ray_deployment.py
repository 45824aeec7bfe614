"""The driver of ``serve --ray`` (``ray_launcher``): starts the services' actors in serve's order,
then the nodes' host agents (``ray_agents``), watches them with the local supervisor's restart
policy, tears them all down."""

from __future__ import annotations

import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from llmplatform.serve.ray_agents import RayAgents
from llmplatform.serve.ray_launcher import (
    POLL_INTERVAL_S, Placement, ServiceActor, forwarded_env,
)
from llmplatform.serve.restarts import ExitDecision, RestartHistory, RestartPolicy, Verdict
from llmplatform.serve.supervisor import STOP_MARGIN_S, ServiceSpec, StateHook

logger = logging.getLogger("llmplatform.serve")


class RayDeployment:
    """The driver: starts the actors in serve's order, watches restarts, tears it all down."""

    def __init__(self, services: list[ServiceSpec], placements_: list[Placement],
                 agents: RayAgents, *, startup_timeout_s: float, shutdown_timeout_s: float,
                 policy: RestartPolicy, log_dir: Path | None,
                 on_state: StateHook = lambda spec, reason, retry_in_s: None) -> None:
        self.services = services
        self.placements = placements_
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.policy = policy
        self.log_dir = log_dir
        self.on_state = on_state
        self.agents = agents
        self.actors: list[Any] = []

    def start(self) -> None:
        import ray

        self._remote = ray.remote(ServiceActor)
        self._here = ray.get_runtime_context().get_node_id()
        # Workers start together (each loads its model); the rest in serve's order.
        groups: list[list[int]] = []
        for i, service in enumerate(self.services):
            if service.name.startswith("worker") and groups and \
                    self.services[groups[-1][0]].name.startswith("worker"):
                groups[-1].append(i)
            else:
                groups.append([i])
        for group in groups:
            started = []
            for i in group:
                actor = self._new_actor(i)
                self.actors.append(actor)
                started.append((self.services[i], actor.get_incarnation.remote()))
            for service, ready in started:
                try:
                    ray.get(ready, timeout=self.startup_timeout_s + 60)
                except ray.exceptions.RayActorError as exc:
                    raise RuntimeError(f"{service.name} could not start: {exc}") from None
                except ray.exceptions.GetTimeoutError:
                    raise RuntimeError(f"{service.name} was not placed and started within "
                                       f"{self.startup_timeout_s:.0f} s (enough CPUs/GPUs in the "
                                       "Ray cluster? `ray status`)") from None
                print(f"llmplatform serve: {service.name} ready at {service.url} (Ray actor)",
                      flush=True)
        self.agents.start()  # the controller is up: they register with it

    def _new_actor(self, i: int) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        service, placement = self.services[i], self.placements[i]
        logger.info("starting %s as a Ray actor: %s", service.name,
                    shlex.join(service.shown_argv or service.argv))
        strategy = (NodeAffinitySchedulingStrategy(self._here, soft=False)
                    if placement.pin_to_driver_node else "DEFAULT")
        return self._remote.options(
            num_cpus=placement.num_cpus, num_gpus=placement.num_gpus,
            max_restarts=-1, max_task_retries=-1, scheduling_strategy=strategy,
        ).remote(service, placement, {**forwarded_env(), **service.env}, self.startup_timeout_s,
                 self.shutdown_timeout_s, str(self.log_dir) if self.log_dir else None)

    def run(self) -> int:
        """Watch the services until one that nothing serves without (the controller, the
        gateway) is in a crash loop, or every worker is left down; returns serve's exit status.

        Ray restarts a dead actor at once (no backoff of ours); each restart counts as an exit
        for the same ``RestartPolicy`` as the local supervisor's. A worker (or the web UI) in a
        crash loop is left down, its actor killed for good, the controller told; it is retried
        later as a new actor, while the rest keeps serving."""
        import ray

        incarnations = [ray.get(a.get_incarnation.remote()) for a in self.actors]
        now = time.monotonic()
        histories = [RestartHistory(self.policy, degradable=s.degradable) for s in self.services]
        for history in histories:
            history.started(now)
        down: dict[int, str] = {}  # left down (until a retry is ready): why
        retry_at: dict[int, float] = {}  # when a service left down is retried
        retrying: dict[int, Any] = {}  # a retried actor's readiness
        while True:
            time.sleep(POLL_INTERVAL_S)
            self.agents.check()
            now = time.monotonic()
            for i, when in list(retry_at.items()):
                if now >= when:
                    del retry_at[i]
                    print(f"llmplatform serve: retrying {self.services[i].name} (left down: "
                          f"{down[i]})", file=sys.stderr, flush=True)
                    self.actors[i] = self._new_actor(i)
                    retrying[i] = self.actors[i].get_incarnation.remote()
                    histories[i].started(now)
            watched = {i: retrying.pop(i, None) or self.actors[i].get_incarnation.remote()
                       for i in range(len(self.actors)) if i not in down or i in retrying}
            ready, _ = ray.wait(list(watched.values()), num_returns=len(watched),
                                timeout=POLL_INTERVAL_S)
            for i, ref in watched.items():
                if ref not in ready:
                    if i in down:
                        retrying[i] = ref  # still starting
                    continue
                name = self.services[i].name
                try:
                    incarnation = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    incarnation, how = None, f"its actor died and cannot restart: {exc}"
                else:
                    how = "its actor died"
                if i in down and incarnation is not None:  # a retry came up
                    incarnations[i] = incarnation
                    del down[i]
                    print(f"llmplatform serve: {name} ready again at {self.services[i].url}",
                          file=sys.stderr, flush=True)
                    self.on_state(self.services[i], None, None)
                    continue
                if incarnation == incarnations[i]:
                    continue
                incarnations[i] = incarnation
                status = self._exited(i, histories[i].exited(now, how), down, retry_at, now)
                if status is not None:
                    return status

    def _exited(self, i: int, decision: ExitDecision, down: dict[int, str],
                retry_at: dict[int, float], now: float) -> int | None:
        import ray

        spec = self.services[i]
        if decision.verdict is Verdict.FATAL:
            print(f"llmplatform serve: error: {spec.name} {decision.reason}; nothing serves "
                  "without it: stopping everything", file=sys.stderr, flush=True)
            return 1
        if decision.verdict is Verdict.RESTART:
            print(f"llmplatform serve: {spec.name} was restarted by Ray: it {decision.reason} "
                  f"(restart {decision.number} of at most {self.policy.max_restarts_per_minute} "
                  f"within {self.policy.window_s:g} s)", file=sys.stderr, flush=True)
            return None
        ray.kill(self.actors[i], no_restart=True)
        down[i], retry_at[i] = decision.reason, now + decision.delay_s
        print(f"llmplatform serve: error: {spec.name} {decision.reason}: left down, retrying it "
              f"in {decision.delay_s:g} s (time {decision.number} in a row)", file=sys.stderr,
              flush=True)
        self.on_state(spec, decision.reason, decision.delay_s)
        workers = [j for j, s in enumerate(self.services) if s.worker_address is not None]
        if workers and all(j in down for j in workers):
            print("llmplatform serve: error: every worker is left down, nothing can serve: "
                  "stopping everything", file=sys.stderr, flush=True)
            return 1
        print(f"llmplatform serve: the rest keeps serving without {spec.name}", file=sys.stderr,
              flush=True)
        return None

    def stop(self) -> None:
        import ray

        # All at once, as the local supervisor does: each drains its own in-flight requests, and
        # the agents' runtime workers drain beside the others.
        pending = self.agents.stopping() + [a.stop.remote() for a in reversed(self.actors)]
        ray.wait(pending, num_returns=len(pending),
                 timeout=max(self.shutdown_timeout_s + 2 * STOP_MARGIN_S,
                             self.agents.stop_timeout_s()))
        self.agents.kill()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
