"""The controller's lifecycle routes (ours; behind the cluster secret like every route), over a
``ModelManager`` (``lifecycle.py``). The gateway's ``/v1/admin/models`` calls them.

| route | request | response |
|---|---|---|
| `/register_agent` | `RegisterAgentRequest` | `{}` (a host agent, at start and every few seconds, with its workers: those of a model this controller does not know, after a restart, are adopted) |
| `/launch_model` | `LaunchModelRequest` | `ModelStatus` (`loading`, or `not_loaded` on demand) |
| `/stop_model` | `StopModelRequest` | `ModelStatus` (`draining`: stopped in the background) |
| `/ensure_model` | `EnsureModelRequest` | `ModelStatus`; starts an on-demand model |
| `/list_model_states` | (GET) | `ListModelStatesResponse` |

Refusals are `{"error": message}` with 400 (bad input, the agent's included), 404 (no such model),
409 (already exists, does not fit, not launched here) or 503 (no agent, agent unreachable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmplatform.controller.agents import AgentCalls, Agents, LifecycleError
from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.lifecycle import ModelManager
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.protocol.lifecycle import (
    AgentHost,
    EnsureModelRequest,
    LaunchModelRequest,
    ListModelStatesResponse,
    ModelStatus,
    RegisterAgentRequest,
    StopModelRequest,
)
from llmplatform.utils.tasks import in_background

logger = logging.getLogger("llmplatform.controller.lifecycle")

TICK_INTERVAL_S = 0.5
"""How often loading models are checked for registration, workers for exits, and on-demand
models for their keep_alive."""


def model_manager(config: ControllerConfig, registry: WorkerRegistry, agents: Agents,
                  client: Callable[[], httpx.AsyncClient], clock: Callable[[], float]) -> ModelManager:
    """The controller's ModelManager (its calls to agents over `client()`, the app's HTTP client
    once the lifespan runs), with the configured on-demand models registered."""
    calls = AgentCalls(client, timeout_s=config.agent_timeout,
                       stop_timeout_s=config.agent_stop_timeout)
    manager = ModelManager(registry, agents, calls, load_timeout=config.model_load_timeout,
                           clock=clock)
    for spec in config.on_demand_models:
        manager.register_on_demand(spec)
    return manager


def add_lifecycle_routes(app: FastAPI, manager: ModelManager, agents: Agents,
                         parse: Callable[..., Awaitable[object]]) -> None:
    """The routes on `app`; `parse(request, model)` is the app's body parser (its 400s)."""

    @app.exception_handler(LifecycleError)
    async def _refused(request: Request, exc: LifecycleError) -> JSONResponse:
        logger.info("%s refused (%d): %s", request.url.path, exc.status, exc)
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.post("/register_agent")
    async def register_agent(request: Request) -> dict:
        body = await parse(request, RegisterAgentRequest)
        assert isinstance(body, RegisterAgentRequest)
        address = body.agent_address.rstrip("/")
        agents.register(address, body.host_name)
        manager.adopt(address, body.host_name, body.processes)
        return {}

    @app.post("/launch_model")
    async def launch_model(request: Request) -> ModelStatus:
        body = await parse(request, LaunchModelRequest)
        assert isinstance(body, LaunchModelRequest)
        return await manager.launch(body)

    @app.post("/stop_model")
    async def stop_model(request: Request) -> ModelStatus:
        body = await parse(request, StopModelRequest)
        assert isinstance(body, StopModelRequest)
        return manager.stop(body.name)

    @app.post("/ensure_model")
    async def ensure_model(request: Request) -> ModelStatus:
        body = await parse(request, EnsureModelRequest)
        assert isinstance(body, EnsureModelRequest)
        return await manager.ensure(body.model)

    @app.get("/list_model_states")
    async def list_model_states() -> ListModelStatesResponse:
        hosts = [AgentHost(host_name=a.host_name, agent_address=a.address) for a in agents.live()]
        return ListModelStatesResponse(models=manager.statuses(), hosts=hosts)


@contextlib.asynccontextmanager
async def watching(manager: ModelManager) -> AsyncIterator[None]:
    """Runs `manager.tick` every TICK_INTERVAL_S while the block runs; on the way out, stops
    the ticks and waits for the stops in progress (or cancels them)."""

    async def loop() -> None:
        while True:
            try:
                await manager.tick()
            except Exception:  # one bad tick must not end the watching
                logger.exception("lifecycle tick failed")
            await asyncio.sleep(TICK_INTERVAL_S)

    try:
        async with in_background(loop(), "controller-lifecycle"):
            yield
    finally:
        await manager.aclose()
