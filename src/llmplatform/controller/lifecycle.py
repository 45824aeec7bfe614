"""Models launched and stopped at runtime: what the controller asked agents for, and its state.

A model's life (``ModelState``):

    launch ──> loading ──(every worker registered)──> ready ──stop──> draining ──> (gone)
                  │                                     │                 └──> not_loaded (on demand)
                  └──(a worker exited / load timeout)───┴──> failed (its workers stopped)
    on-demand: not_loaded ──(first request: ensure)──> loading ──> ... ; ready ──(idle past
    keep_alive)──> draining ──> not_loaded

Draining marks the model's workers in the registry, so nothing new is routed to them (not by the
controller, and not by a gateway's table, which reads the registry's listing), then asks their
agent to stop each: SIGTERM, on which a worker deregisters and lets its in-flight requests finish.

Idle: a model is in use while a request for it is dispatched (`touch`) or any of its workers
reports requests running or queued; `idle_s` counts from the last such moment. Memory pressure:
a launch an agent refuses as not fitting (409) first stops, least recently used first, the idle
ready on-demand models on that agent (they start again on their next request), then retries.

In memory only, like the registry; a restarted controller loses nothing all the same: each agent
reports the workers it runs with the launch that started them (every few seconds), and the
models this controller does not know are adopted as they were launched (`adopt`). A model whose
agent no longer runs its workers (the agent restarted) is failed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmplatform.controller.agents import Agents, AgentCalls, LifecycleError
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.protocol.lifecycle import (
    AgentProcess,
    LaunchModelRequest,
    LaunchWorkersRequest,
    ModelState,
    ModelStatus,
    ProcessState,
)

logger = logging.getLogger("llmplatform.controller.lifecycle")

DEFAULT_LOAD_TIMEOUT_S = 600.0
STOPPED_MEMORY = 1024


@dataclass
class ManagedModel:
    spec: LaunchModelRequest
    state: ModelState
    last_used: float
    agent: str | None = None
    host_name: str | None = None
    workers: list[str] = field(default_factory=list)
    started_at: float | None = None
    reason: str | None = None


class ModelManager:
    def __init__(self, registry: WorkerRegistry, agents: Agents, calls: AgentCalls, *,
                 load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._agents = agents
        self._calls = calls
        self._load_timeout = load_timeout
        self._clock = clock
        self._models: dict[str, ManagedModel] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopped_order: collections.deque[str] = collections.deque(maxlen=STOPPED_MEMORY)
        self._stopped: set[str] = set()
        """Workers stopped here lately: an agent's report sent before their stop was done must
        not bring them back (`adopt`)."""

    # ---- requests -------------------------------------------------------------------------------

    async def launch(self, spec: LaunchModelRequest) -> ModelStatus:
        """Start `spec`'s workers (or only register it, on demand); 409 if the name is taken."""
        if spec.name in self._models or spec.name in self._registry.list_models():
            raise LifecycleError(f"a model named {spec.name!r} already exists; stop it first "
                                 "(DELETE /v1/admin/models/NAME) or choose another name", 409)
        state = ModelState.NOT_LOADED if spec.on_demand else ModelState.LOADING
        model = ManagedModel(spec, state, last_used=self._clock())
        self._models[spec.name] = model  # the name is taken while the agent is asked
        try:
            if spec.on_demand:  # bad flags or path are found now, not by its first request
                agent = self._agents.named(spec.host)[0]
                await self._calls.launch(agent.address, self._request(spec, check_only=True))
            else:
                await self._start(model)
        except LifecycleError:
            if self._models.get(spec.name) is model:
                del self._models[spec.name]  # nothing was started: as if never asked
            raise
        return self.status(model)

    def register_on_demand(self, spec: LaunchModelRequest) -> None:
        """A launchable model known from the start (the controller's --on-demand-model)."""
        spec = spec.model_copy(update={"on_demand": True})
        self._models[spec.name] = ManagedModel(spec, ModelState.NOT_LOADED, last_used=self._clock())

    async def ensure(self, name: str) -> ModelStatus:
        """A request wants `name`: an on-demand model not running (or failed) is started."""
        model = self._models.get(name)
        if model is None or not model.spec.on_demand:
            raise LifecycleError(f"the model {name!r} is not launchable on demand", 404)
        model.last_used = self._clock()
        if model.state in (ModelState.NOT_LOADED, ModelState.FAILED):
            model.state, model.reason = ModelState.LOADING, None
            try:
                await self._start(model)
            except LifecycleError as exc:
                model.state, model.reason = ModelState.FAILED, str(exc)
                raise
        return self.status(model)

    def stop(self, name: str) -> ModelStatus:
        """Begin draining `name` (404 unknown; 409 for workers this controller did not start)."""
        model = self._models.get(name)
        if model is None:
            if name in self._registry.list_models():
                raise LifecycleError(f"the model {name!r} is served by workers not launched "
                                     "through this API; stop them where they were started", 409)
            raise LifecycleError(f"the model {name!r} does not exist", 404)
        if model.state is ModelState.DRAINING:
            return self.status(model)
        if not model.workers:  # not loaded, or failed with its workers gone: just forget it
            del self._models[name]
            return ModelStatus(name=name, state=ModelState.NOT_LOADED, on_demand=model.spec.on_demand)
        self._drain(model, then=None)
        return self.status(model)

    def adopt(self, agent: str, host_name: str, processes: list[AgentProcess]) -> None:
        """Take over the running workers an agent reports for models this controller does not
        know: it restarted, and the models keep their state (as launched) and can be stopped."""
        known = {w for m in self._models.values() for w in m.workers} | self._stopped
        found: dict[str, list[AgentProcess]] = {}
        for process in processes:
            if (process.state is ProcessState.RUNNING and process.spec is not None
                    and process.worker_address not in known):
                found.setdefault(process.spec.name, []).append(process)
        for name, workers in found.items():
            existing = self._models.get(name)
            if existing is not None and not (existing.state is ModelState.NOT_LOADED
                                             and not existing.workers):
                continue  # being launched or stopped here right now
            spec = workers[0].spec
            assert spec is not None
            now = self._clock()
            self._models[name] = ManagedModel(
                spec, ModelState.LOADING, last_used=now, agent=agent, host_name=host_name,
                workers=[w.worker_address for w in workers], started_at=now)
            logger.info("took over %s on %s (%d worker(s) its agent runs)", name, host_name,
                        len(workers))

    def touch(self, name: str) -> None:
        model = self._models.get(name)
        if model is not None:
            model.last_used = self._clock()

    # ---- starting and stopping ------------------------------------------------------------------

    async def _start(self, model: ManagedModel) -> None:
        spec = model.spec
        request = self._request(spec)
        candidates = self._agents.named(spec.host)
        while True:
            agent = candidates[0]
            try:
                answer = await self._calls.launch(agent.address, request)
                break
            except LifecycleError as exc:
                if exc.status != 409 or not await self._make_room(agent.address, spec.name):
                    if exc.status == 409 and len(candidates) > 1:
                        candidates = candidates[1:]  # another host may have the memory
                        continue
                    raise
        model.agent, model.host_name = agent.address, agent.host_name
        model.workers = [w.worker_address for w in answer.workers]
        if self._models.get(spec.name) is not model:  # stopped while the agent was starting them
            self._stop_workers(model, then=None)
            raise LifecycleError(f"the model {spec.name!r} was stopped while it was launched", 409)
        model.state, model.started_at, model.reason = ModelState.LOADING, self._clock(), None
        logger.info("launched %s on %s: %s", spec.name, agent.host_name, ", ".join(model.workers))

    @staticmethod
    def _request(spec: LaunchModelRequest, *, check_only: bool = False) -> LaunchWorkersRequest:
        return LaunchWorkersRequest(
            model_name=spec.name, model_path=spec.model_path, backend=spec.backend,
            kv_cache_memory=spec.kv_cache_memory, worker_args=spec.worker_args,
            replicas=spec.replicas, spec=spec, check_only=check_only)

    async def _make_room(self, agent: str, for_name: str) -> bool:
        """Stop the least recently used idle on-demand model on `agent`; False if none."""
        idle = [m for m in self._models.values()
                if m.agent == agent and m.spec.on_demand and m.state is ModelState.READY
                and m.spec.name != for_name and not self._busy(m)]
        if not idle:
            return False
        victim = min(idle, key=lambda m: m.last_used)
        logger.info("memory pressure: unloading idle on-demand model %s for %s",
                    victim.spec.name, for_name)
        await self._drain(victim, then=ModelState.NOT_LOADED)
        return True

    def _stop_workers(self, model: ManagedModel, *, then: ModelState | None) -> asyncio.Task:
        """Route nothing more to `model`'s workers and stop them in the background; afterwards
        the model is forgotten (`then` None) or left in state `then`."""
        for worker in model.workers:
            self._registry.set_draining(worker)
        task = asyncio.create_task(self._stop_now(model, list(model.workers), model.agent, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _stop_now(self, model: ManagedModel, workers: list[str], agent: str | None,
                        then: ModelState | None) -> None:
        assert agent is not None
        results = await asyncio.gather(*(self._calls.stop(agent, w) for w in workers),
                                       return_exceptions=True)
        for worker, result in zip(workers, results):
            if isinstance(result, BaseException) and not (
                    isinstance(result, LifecycleError) and result.status == 404):  # gone already
                logger.warning("stopping worker %s of %s: %s", worker, model.spec.name, result)
            self._registry.remove(worker)
            self._remember_stopped(worker)
        model.workers, model.agent = [w for w in model.workers if w not in workers], None
        if then is None:
            if self._models.get(model.spec.name) is model:
                del self._models[model.spec.name]
        else:
            model.state = then
        logger.info("stopped the workers of %s", model.spec.name)

    def _remember_stopped(self, worker: str) -> None:
        if len(self._stopped_order) == self._stopped_order.maxlen:
            self._stopped.discard(self._stopped_order[0])
        self._stopped_order.append(worker)
        self._stopped.add(worker)

    def _drain(self, model: ManagedModel, *, then: ModelState | None) -> asyncio.Task:
        model.state = ModelState.DRAINING
        return self._stop_workers(model, then=then)

    def _fail(self, model: ManagedModel, reason: str) -> None:
        logger.warning("model %s failed: %s", model.spec.name, reason)
        model.state, model.reason = ModelState.FAILED, reason
        self._stop_workers(model, then=ModelState.FAILED)  # nothing half-started stays

    # ---- watching -------------------------------------------------------------------------------

    def _busy(self, model: ManagedModel) -> bool:
        for worker in model.workers:
            info = self._registry.get(worker)
            if info is not None and (info.queue_length or info.num_running or info.num_waiting):
                return True
        return False

    async def tick(self) -> None:
        """Advance every model: loading -> ready or failed, ready -> failed when a worker
        exited, idle on-demand models past their keep_alive -> unloaded."""
        now = self._clock()
        watched = [m for m in self._models.values()
                   if m.state in (ModelState.LOADING, ModelState.READY) and m.agent is not None]
        statuses = {}
        for agent in {m.agent for m in watched}:
            try:
                statuses[agent] = await self._calls.status(agent)  # type: ignore[arg-type]
            except LifecycleError as exc:
                logger.warning("host agent %s: %s", agent, exc)
        for model in watched:
            if model.state not in (ModelState.LOADING, ModelState.READY):
                continue  # changed while the agents were asked
            status = statuses.get(model.agent)  # type: ignore[arg-type]
            processes = {p.worker_address: p for p in status.processes} if status else {}
            exited = [processes[w] for w in model.workers
                      if w in processes and processes[w].state is ProcessState.EXITED]
            if exited:
                self._fail(model, exited[0].exit_reason or "a worker exited")
                continue
            if status is not None and any(w not in processes for w in model.workers):
                # The agent restarted (its workers went with it), or forgot them.
                self._fail(model, f"its host agent on {model.host_name} no longer runs its workers")
                continue
            if self._busy(model):
                model.last_used = now
            registered = sum(self._registry.is_live(w) for w in model.workers)
            if model.state is ModelState.LOADING:
                if registered == len(model.workers):
                    model.state, model.last_used = ModelState.READY, now  # idle from here
                    logger.info("%s is ready", model.spec.name)
                elif model.started_at is not None and now - model.started_at > self._load_timeout:
                    self._fail(model, f"not every worker registered within {self._load_timeout:g} s")
            elif (model.spec.on_demand and model.spec.keep_alive is not None
                  and now - model.last_used > model.spec.keep_alive):
                logger.info("%s idle for %.0f s (keep_alive %g s): unloading", model.spec.name,
                            now - model.last_used, model.spec.keep_alive)
                self._drain(model, then=ModelState.NOT_LOADED)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- listing --------------------------------------------------------------------------------

    def status(self, model: ManagedModel) -> ModelStatus:
        spec, now = model.spec, self._clock()
        progress = None
        if model.state is ModelState.LOADING and model.started_at is not None:
            registered = sum(self._registry.is_live(w) for w in model.workers)
            progress = (f"{registered}/{len(model.workers)} workers registered, "
                        f"{now - model.started_at:.0f} s")
        return ModelStatus(
            name=spec.name, state=model.state, progress=progress, reason=model.reason,
            replicas=spec.replicas, workers=list(model.workers), host=model.host_name,
            model_path=spec.model_path, on_demand=spec.on_demand, keep_alive=spec.keep_alive,
            idle_s=round(now - model.last_used, 1))

    def statuses(self) -> list[ModelStatus]:
        """Every model: those managed here, and those served by other workers (ready)."""
        listed = [self.status(m) for m in self._models.values()]
        others = [ModelStatus(name=name, state=ModelState.READY, managed=False,
                              replicas=len(self._registry.workers_for(name)),
                              workers=[w.worker_name for w in self._registry.workers_for(name)])
                  for name in self._registry.list_models() if name not in self._models]
        return sorted(listed + others, key=lambda s: s.name)
