"""The controller's ModelManager with exact expectations: a fake host agent (the calls only; the
real one is tests/integration/test_model_lifecycle.py's), a real registry, a hand-moved clock."""

from __future__ import annotations

import asyncio

import pytest

from llmplatform.controller.agents import Agents, LifecycleError
from llmplatform.controller.lifecycle import ModelManager
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.protocol.controller import WorkerStatus
from llmplatform.protocol.lifecycle import (
    AgentProcess,
    AgentStatus,
    LaunchModelRequest,
    LaunchWorkersRequest,
    LaunchWorkersResponse,
    ModelState,
    ProcessState,
)

AGENT = "http://agent:1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeAgent:
    """Starts 'workers' (addresses), fits at most `capacity` of them at once."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.running: dict[str, str] = {}  # address -> model
        self.specs: dict[str, LaunchModelRequest | None] = {}  # address -> the launch
        self.exited: dict[str, str] = {}  # address -> reason
        self.launches: list[str] = []
        self.stops: list[str] = []
        self._ports = iter(range(9000, 9999))

    async def launch(self, agent: str, request: LaunchWorkersRequest) -> LaunchWorkersResponse:
        if request.model_path != "/m":
            raise LifecycleError(f"model_path {request.model_path!r} is not a checkpoint", 400)
        if request.check_only:
            return LaunchWorkersResponse(workers=[])
        if len(self.running) + request.replicas > self.capacity:
            raise LifecycleError("does not fit; would fit: nothing", 409)
        self.launches.append(request.model_name)
        workers = []
        for _ in range(request.replicas):
            address = f"http://w:{next(self._ports)}"
            self.running[address] = request.model_name
            self.specs[address] = request.spec
            workers.append(AgentProcess(worker_address=address, model_name=request.model_name,
                                        pid=1, state=ProcessState.RUNNING, spec=request.spec))
        return LaunchWorkersResponse(workers=workers)

    async def stop(self, agent: str, worker_address: str) -> AgentProcess:
        self.stops.append(worker_address)
        model = self.running.pop(worker_address)
        return AgentProcess(worker_address=worker_address, model_name=model, pid=1,
                            state=ProcessState.EXITED)

    async def status(self, agent: str) -> AgentStatus:
        processes = [AgentProcess(worker_address=a, model_name=m, pid=1,
                                  state=ProcessState.RUNNING, spec=self.specs[a])
                     for a, m in self.running.items()]
        processes += [AgentProcess(worker_address=a, model_name="?", pid=1,
                                   state=ProcessState.EXITED, exit_reason=r)
                      for a, r in self.exited.items()]
        return AgentStatus(host_name="h", processes=processes)


def setup(capacity: int = 8, load_timeout: float = 60.0):
    clock = Clock()
    registry = WorkerRegistry(heartbeat_expiration=1e9, clock=clock)
    agents = Agents(clock)
    agents.register(AGENT, "h")
    fake = FakeAgent(capacity)
    manager = ModelManager(registry, agents, fake, load_timeout=load_timeout,  # type: ignore[arg-type]
                           clock=clock)
    return clock, registry, fake, manager


def register(registry: WorkerRegistry, fake: FakeAgent, model: str, *, queue: int = 0) -> None:
    for address, name in fake.running.items():
        if name == model:
            registry.register(address, WorkerStatus(model_names=[model], speed=1, queue_length=queue))


def spec(name: str, **extra) -> LaunchModelRequest:
    return LaunchModelRequest(name=name, model_path="/m", **extra)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_loading_becomes_ready_when_every_replica_registered():
    clock, registry, fake, manager = setup()
    status = await manager.launch(spec("a", replicas=2))
    assert status.state is ModelState.LOADING and len(status.workers) == 2
    first = status.workers[0]
    registry.register(first, WorkerStatus(model_names=["a"], speed=1, queue_length=0))
    clock.now += 3
    await manager.tick()
    [listed] = manager.statuses()
    assert listed.state is ModelState.LOADING and listed.progress == "1/2 workers registered, 3 s"
    register(registry, fake, "a")
    await manager.tick()
    assert manager.statuses()[0].state is ModelState.READY


async def test_a_name_taken_by_any_worker_is_a_conflict_and_nothing_starts():
    clock, registry, fake, manager = setup()
    registry.register("http://other:1", WorkerStatus(model_names=["x"], speed=1, queue_length=0))
    with pytest.raises(LifecycleError) as refused:
        await manager.launch(spec("x"))
    assert refused.value.status == 409 and fake.launches == []
    [listed] = manager.statuses()
    assert listed.name == "x" and listed.managed is False


async def test_stop_drains_then_forgets():
    clock, registry, fake, manager = setup()
    await manager.launch(spec("a"))
    register(registry, fake, "a")
    await manager.tick()
    [worker] = manager.statuses()[0].workers
    assert manager.stop("a").state is ModelState.DRAINING
    # Routed nothing from the moment the stop is asked, before the worker has exited.
    assert registry.workers_for("a") == [] and registry.list_models() == []
    await settle()
    assert fake.stops == [worker] and manager.statuses() == []
    with pytest.raises(LifecycleError) as unknown:
        manager.stop("a")
    assert unknown.value.status == 404


async def test_a_worker_that_exits_while_loading_fails_the_model_and_stops_the_others():
    clock, registry, fake, manager = setup()
    status = await manager.launch(spec("a", replicas=2))
    dead, alive = status.workers
    fake.running.pop(dead)
    fake.exited[dead] = "worker exited (exit code 1); its log ends: CUDA out of memory"
    await manager.tick()
    await settle()
    [listed] = manager.statuses()
    assert listed.state is ModelState.FAILED and "out of memory" in (listed.reason or "")
    assert alive in fake.stops and fake.running == {}


async def test_load_timeout_fails_the_model():
    clock, registry, fake, manager = setup(load_timeout=10)
    await manager.launch(spec("a"))
    clock.now += 11
    await manager.tick()
    await settle()
    [listed] = manager.statuses()
    assert listed.state is ModelState.FAILED and "within 10 s" in (listed.reason or "")
    assert fake.running == {}


async def test_on_demand_starts_on_ensure_and_unloads_after_keep_alive():
    clock, registry, fake, manager = setup()
    assert (await manager.launch(spec("lazy", on_demand=True, keep_alive=30))).state is ModelState.NOT_LOADED
    assert fake.launches == []
    assert (await manager.ensure("lazy")).state is ModelState.LOADING
    assert (await manager.ensure("lazy")).state is ModelState.LOADING  # one start, not two
    assert fake.launches == ["lazy"]
    register(registry, fake, "lazy")
    clock.now += 25  # loading took a while: idle counts from ready, not from the request
    await manager.tick()
    clock.now += 20
    await manager.tick()
    manager.touch("lazy")  # a request routed to it
    clock.now += 20
    await manager.tick()
    assert manager.statuses()[0].state is ModelState.READY  # 20 s idle < 30
    clock.now += 11
    await manager.tick()
    await settle()
    [listed] = manager.statuses()
    assert listed.state is ModelState.NOT_LOADED and listed.workers == [] and fake.running == {}
    with pytest.raises(LifecycleError) as not_launchable:
        await manager.ensure("nothing")
    assert not_launchable.value.status == 404


async def test_a_busy_worker_keeps_its_model_alive():
    clock, registry, fake, manager = setup()
    await manager.launch(spec("lazy", on_demand=True, keep_alive=30))
    await manager.ensure("lazy")
    register(registry, fake, "lazy", queue=1)  # a request in flight, reported by its heartbeat
    await manager.tick()
    clock.now += 100
    await manager.tick()
    assert manager.statuses()[0].state is ModelState.READY


async def test_memory_pressure_unloads_the_least_recently_used_idle_on_demand_model():
    clock, registry, fake, manager = setup(capacity=2)
    for name in ("old", "recent"):
        await manager.launch(spec(name, on_demand=True))
        await manager.ensure(name)
        register(registry, fake, name)
        clock.now += 1
    await manager.tick()
    manager.touch("recent")
    status = await manager.launch(spec("new"))  # does not fit beside both
    assert status.state is ModelState.LOADING
    states = {s.name: s.state for s in manager.statuses()}
    assert states == {"old": ModelState.NOT_LOADED, "recent": ModelState.READY,
                      "new": ModelState.LOADING}
    assert sorted(fake.running.values()) == ["new", "recent"]


async def test_a_launch_that_does_not_fit_and_frees_nothing_is_refused_and_forgotten():
    clock, registry, fake, manager = setup(capacity=1)
    await manager.launch(spec("explicit"))  # launched explicitly: never unloaded for room
    register(registry, fake, "explicit")
    await manager.tick()
    with pytest.raises(LifecycleError) as refused:
        await manager.launch(spec("new"))
    assert refused.value.status == 409
    assert [s.name for s in manager.statuses()] == ["explicit"]


async def test_a_model_stopped_while_its_workers_start_leaves_none_running():
    clock, registry, fake, manager = setup()
    await manager.launch(spec("lazy", on_demand=True))
    started = asyncio.Event()
    release = asyncio.Event()
    launch = fake.launch

    async def slow_launch(agent, request):
        started.set()
        await release.wait()
        return await launch(agent, request)

    fake.launch = slow_launch  # type: ignore[method-assign]
    ensuring = asyncio.create_task(manager.ensure("lazy"))
    await started.wait()
    manager.stop("lazy")  # no workers yet: forgotten at once
    release.set()
    with pytest.raises(LifecycleError) as stopped:
        await ensuring
    assert stopped.value.status == 409
    await settle()
    assert fake.running == {} and manager.statuses() == []


def test_the_agent_needs_the_cluster_secret(tmp_path):
    from fastapi.testclient import TestClient

    from llmplatform.serve.agent import AgentConfig, create_app
    from llmplatform.utils.cluster_secret import SECRET_HEADER

    app = create_app(AgentConfig(controller_address="http://127.0.0.1:9", cluster_secret="s3",
                                 log_dir=tmp_path))
    body = {"model_name": "m", "model_path": str(tmp_path), "backend": "paged"}
    with TestClient(app) as client:
        assert client.post("/launch_workers", json=body).status_code == 401
        assert client.get("/list_processes").status_code == 401
        assert client.get("/health").status_code == 200
        refused = client.post("/launch_workers", json=body, headers={SECRET_HEADER: "s3"})
        assert refused.status_code == 400 and "no weight files" in refused.json()["error"]


async def test_a_restarted_controller_adopts_what_the_agents_run():
    clock, registry, fake, manager = setup()
    await manager.launch(spec("a", replicas=2))
    await manager.launch(spec("lazy", on_demand=True, keep_alive=30))
    await manager.ensure("lazy")
    [b_worker] = (await manager.launch(spec("b"))).workers
    manager.stop("b")
    report = (await fake.status(AGENT)).processes  # sent before b's stop was done
    await settle()
    manager.adopt(AGENT, "h", report)  # the same controller: nothing new
    assert sorted(s.name for s in manager.statuses()) == ["a", "lazy"]

    # A new controller (same registry for brevity: the workers register again by themselves).
    _, _, _, restarted = setup()
    restarted._calls = fake  # type: ignore[attr-defined]  # the same agent's workers
    restarted._registry = registry  # type: ignore[attr-defined]
    restarted.register_on_demand(spec("lazy", keep_alive=30))  # from its --on-demand-model
    restarted.adopt(AGENT, "h", (await fake.status(AGENT)).processes + [
        p for p in report if p.worker_address == b_worker])
    adopted = {s.name: s for s in restarted.statuses()}
    assert sorted(adopted) == ["a", "b", "lazy"]
    assert adopted["a"].state is ModelState.LOADING and len(adopted["a"].workers) == 2
    assert adopted["lazy"].on_demand and adopted["lazy"].keep_alive == 30
    register(registry, fake, "a")
    register(registry, fake, "lazy")
    await restarted.tick()
    states = {s.name: (s.state, s.reason) for s in restarted.statuses()}
    assert states["a"][0] is ModelState.READY and states["lazy"][0] is ModelState.READY
    # b's worker was gone before this controller asked: failed, not served.
    assert states["b"][0] is ModelState.FAILED and "no longer runs" in (states["b"][1] or "")
    restarted.stop("a")
    await settle()
    assert "a" not in fake.running.values()


async def test_an_on_demand_model_with_a_bad_path_is_refused_when_registered():
    clock, registry, fake, manager = setup()
    with pytest.raises(LifecycleError) as refused:
        await manager.launch(LaunchModelRequest(name="lazy", model_path="/nowhere", on_demand=True))
    assert refused.value.status == 400 and manager.statuses() == [] and fake.running == {}


def test_a_launch_the_host_cannot_start_whole_leaves_no_process(tmp_path, monkeypatch):
    import subprocess

    from llmplatform.serve import agent_processes
    from llmplatform.serve.agent_processes import WorkerProcesses
    from tests.processes import alive

    spawned: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(argv, **kwargs):  # the first replica starts (a stand-in process), the second cannot
        if spawned:
            raise OSError(11, "Resource temporarily unavailable")
        spawned.append(real_popen(["sleep", "60"], **kwargs))
        return spawned[-1]

    monkeypatch.setattr(agent_processes.subprocess, "Popen", popen)
    processes = WorkerProcesses(host="127.0.0.1", controller_address="http://127.0.0.1:9",
                                cluster_secret=None, log_dir=tmp_path, shutdown_timeout=1,
                                log_args=[])
    request = LaunchWorkersRequest(model_name="m", model_path="/m", backend="paged", replicas=2)
    with pytest.raises(OSError):
        processes.start(request, per_worker_bytes=1)
    assert processes.listing() == [] and not alive(spawned[0].pid)


def test_what_would_fit_is_said_in_numbers(tmp_path):
    from llmplatform.serve.launch_checks import LaunchRefused, check_fit

    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))  # 1 MiB of weights
    (tmp_path / "config.json").write_text("{}")  # not weights: not counted
    request = LaunchWorkersRequest(model_name="m", model_path=str(tmp_path), backend="paged",
                                   kv_cache_memory="3MiB", replicas=2)
    assert check_fit(request, free_bytes=8 << 20).per_worker_bytes == 4 << 20
    with pytest.raises(LaunchRefused) as refused:
        check_fit(request, free_bytes=6 << 20)
    assert refused.value.status == 409
    assert str(refused.value) == (
        "2 worker(s) of 'm' need 8.00 MiB (1.00 MiB of weights + 3.00 MiB of KV pool each) but "
        "6.00 MiB is free on this host; would fit: 1 replica(s) with this KV pool or "
        "kv_cache_memory of at most 2.00 MiB per worker for 2 replica(s)")
    with pytest.raises(LaunchRefused) as nothing:
        check_fit(request, free_bytes=1 << 19)
    assert str(nothing.value).endswith("would fit: nothing: not even the weights fit")
