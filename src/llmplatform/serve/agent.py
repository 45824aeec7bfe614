"""The host agent: the controller's hands on one host. It starts and stops model workers there
when the controller asks, after checking they fit (``launch_checks``), and registers itself with
the controller (again every few seconds, so a restarted controller learns of it).

Routes (POST with a JSON body, except the GETs; every one but /health needs the cluster secret):

| route | request | response |
|---|---|---|
| `/launch_workers` | `LaunchWorkersRequest` | `LaunchWorkersResponse`; 400 bad flags or path, 409 does not fit: `{"error": message}`; with `check_only`, the checks but memory, and no worker |
| `/stop_worker` | `StopWorkerRequest` | the stopped worker's `AgentProcess`, once it has exited; 404 unknown |
| `/list_processes` | (GET) | `AgentStatus` |
| `/health` | (GET) | 200 |

A launch is checked and started under one lock, so two launches cannot both count the same free
memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from llmplatform.errors import InvalidRequestError
from llmplatform.protocol.lifecycle import (
    AgentProcess,
    AgentStatus,
    LaunchWorkersRequest,
    LaunchWorkersResponse,
    RegisterAgentRequest,
    StopWorkerRequest,
)
from llmplatform.serve.agent_processes import WorkerProcesses
from llmplatform.serve.launch_checks import (
    LaunchRefused,
    check_fit,
    check_worker_args,
    host_free_bytes,
    kv_bytes,
    weights_bytes,
)
from llmplatform.utils.cluster_secret import ClusterSecretMiddleware, secret_headers
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.server import serve_in_thread

logger = logging.getLogger("llmplatform.serve.agent")


@dataclass(frozen=True)
class AgentConfig:
    controller_address: str
    agent_address: str | None = None
    """What the controller reaches this agent at; None: `app.state.agent_address`, set once it
    listens on a port picked then (serve's own agent, tests)."""
    host: str = "127.0.0.1"
    """Where its workers bind."""
    host_name: str = field(default_factory=socket.gethostname)
    cluster_secret: str | None = None
    memory_limit_bytes: int | None = None
    """At most this much for its workers' weights and KV pools together (None: the host's)."""
    log_dir: Path = Path("/tmp/llmplatform-agent")
    worker_shutdown_timeout: float = 30.0
    register_interval: float = 3.0
    log_args: tuple[str, ...] = ()


class Workers(Protocol):
    """What an agent starts its workers with: processes of its own (``WorkerProcesses``), or
    Ray actors on its node under `serve --ray` (``ray_agent.RayWorkers``)."""

    def reserved_bytes(self) -> int: ...
    def listing(self) -> list[AgentProcess]: ...
    def knows(self, address: str) -> bool: ...
    async def launch(self, request: LaunchWorkersRequest,
                     per_worker_bytes: int) -> list[AgentProcess]: ...
    async def stop(self, address: str) -> AgentProcess: ...
    async def stop_all(self) -> None: ...


def free_bytes(config: AgentConfig, processes: Workers, worker_args: list[str]) -> int:
    free = host_free_bytes(worker_args)
    if config.memory_limit_bytes is not None:
        free = min(free, config.memory_limit_bytes - processes.reserved_bytes())
    return max(0, free)


async def register_periodically(app: FastAPI, config: AgentConfig, client: httpx.AsyncClient) -> None:
    """Tell the controller this agent exists and which workers it runs, now and every
    `register_interval` seconds."""
    while True:
        address = config.agent_address or getattr(app.state, "agent_address", None)
        if address is not None:
            processes = await asyncio.to_thread(app.state.processes.listing)
            body = RegisterAgentRequest(agent_address=address, host_name=config.host_name,
                                        processes=processes)
            try:
                response = await client.post(f"{config.controller_address}/register_agent",
                                             json=body.model_dump(mode="json"))
                if response.status_code != 200:
                    logger.warning("the controller answered %d to /register_agent: %s",
                                   response.status_code, response.text[:200])
            except httpx.HTTPError as exc:
                logger.warning("could not register with the controller at %s: %s",
                               config.controller_address, exc)
        await asyncio.sleep(config.register_interval)


def create_app(config: AgentConfig, processes: Workers | None = None) -> FastAPI:
    """The agent's app; its workers are processes of its own unless `processes` says otherwise."""
    if processes is None:
        processes = WorkerProcesses(
            host=config.host, controller_address=config.controller_address,
            cluster_secret=config.cluster_secret, log_dir=config.log_dir,
            shutdown_timeout=config.worker_shutdown_timeout, log_args=list(config.log_args))
    launch_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0),
                                     headers=secret_headers(config.cluster_secret)) as client:
            registering = asyncio.create_task(register_periodically(app, config, client))
            try:
                yield
            finally:
                registering.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await registering
                await processes.stop_all()  # no worker outlives its agent

    app = FastAPI(title="llmplatform host agent", lifespan=lifespan)
    app.state.processes = processes
    if config.cluster_secret:
        app.add_middleware(ClusterSecretMiddleware, secret=config.cluster_secret,
                           exempt_paths=("/health",))

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=400)

    @app.exception_handler(LaunchRefused)
    async def _refused(request: Request, exc: LaunchRefused) -> JSONResponse:
        logger.info("refused a launch: %s", exc)
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.post("/launch_workers")
    async def launch_workers(request: Request) -> LaunchWorkersResponse:
        body = parse_json_body(LaunchWorkersRequest, await request.body())
        # Parsing flags and listing files are quick but touch the disk: off the event loop.
        await asyncio.to_thread(check_worker_args, body)
        if body.check_only:
            await asyncio.to_thread(weights_bytes, body.model_path)  # the path, at least
            await asyncio.to_thread(kv_bytes, body)
            return LaunchWorkersResponse(workers=[])
        async with launch_lock:
            free = await asyncio.to_thread(free_bytes, config, processes, body.worker_args)
            fit = await asyncio.to_thread(check_fit, body, free)
            started = await processes.launch(body, fit.per_worker_bytes)
        return LaunchWorkersResponse(workers=started)

    @app.post("/stop_worker")
    async def stop_worker(request: Request) -> JSONResponse:
        body = parse_json_body(StopWorkerRequest, await request.body())
        if not processes.knows(body.worker_address):
            return JSONResponse({"error": f"no worker {body.worker_address} on this agent"},
                                status_code=404)
        stopped = await processes.stop(body.worker_address)
        return JSONResponse(stopped.model_dump(mode="json"))

    @app.get("/list_processes")
    async def list_processes() -> AgentStatus:
        # An exited worker's description reads the end of its log: off the event loop.
        listing = await asyncio.to_thread(processes.listing)
        return AgentStatus(host_name=config.host_name, processes=listing)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def start_agent(stack: contextlib.ExitStack, config: AgentConfig, port: int,
                processes: Workers | None = None, *,
                advertise_host: str | None = None) -> tuple[FastAPI, str]:
    """Serve an agent on a thread (`stack` stops it) and register it with the controller once
    at once, so that a launch right after its start finds it (then every few seconds, from its
    lifespan). Returns the app and the address it registered under: where it listens, with
    `advertise_host` instead of the bind address when given (a wildcard bind). RuntimeError
    when it cannot start or register."""
    app = create_app(config, processes)
    try:
        url = stack.enter_context(serve_in_thread(app, config.host, port))
    except RuntimeError as exc:
        raise RuntimeError(f"the host agent could not start: {exc}") from None
    if advertise_host is not None:
        url = f"http://{advertise_host}:{url.rsplit(':', 1)[1]}"
    app.state.agent_address = url  # its registration loop starts once it is known
    try:
        response = httpx.post(f"{config.controller_address}/register_agent",
                              json={"agent_address": url, "host_name": config.host_name},
                              headers=secret_headers(config.cluster_secret), timeout=10)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"the host agent could not register with the controller: {exc}") from None
    if response.status_code != 200:
        raise RuntimeError(f"the controller answered {response.status_code} to the host "
                           f"agent's registration: {response.text[:200]}")
    return app, url
