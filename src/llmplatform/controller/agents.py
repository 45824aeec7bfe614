"""The host agents that registered with this controller, and the calls the controller makes to
them (``serve/agent.py`` is the other side). An agent registers at start and again every few
seconds; one not heard from for `AGENT_EXPIRATION_S` is no longer offered launches."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, ValidationError

from llmplatform.protocol.lifecycle import (
    AgentProcess,
    AgentStatus,
    LaunchWorkersRequest,
    LaunchWorkersResponse,
    StopWorkerRequest,
)

AGENT_EXPIRATION_S = 30.0


class LifecycleError(Exception):
    """A lifecycle request the controller answers with `status` and `{"error": message}`: the
    agent's own 400/409, or the controller's 404/409/503."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Agent:
    address: str
    host_name: str
    last_seen: float


class Agents:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._agents: dict[str, Agent] = {}

    def register(self, address: str, host_name: str) -> None:
        self._agents[address] = Agent(address, host_name, self._clock())

    def live(self) -> list[Agent]:
        now = self._clock()
        return [a for a in self._agents.values() if now - a.last_seen <= AGENT_EXPIRATION_S]

    def named(self, host_name: str | None) -> list[Agent]:
        """The live agents a launch may go to: the one on `host_name`, or any."""
        live = self.live()
        if host_name is None:
            if not live:
                raise LifecycleError("no host agent is registered with the controller: start "
                                     "one (`llmplatform serve` does) to launch models", 503)
            return live
        chosen = [a for a in live if a.host_name == host_name]
        if not chosen:
            known = ", ".join(sorted(a.host_name for a in live)) or "none"
            raise LifecycleError(f"no host agent named {host_name!r} (registered: {known})", 400)
        return chosen


class AgentCalls:
    """The controller's calls to agents, over its HTTP client (which carries the secret)."""

    def __init__(self, client: Callable[[], httpx.AsyncClient], *, timeout_s: float,
                 stop_timeout_s: float) -> None:
        self._client = client
        self._timeout = httpx.Timeout(timeout_s)
        self._stop_timeout = httpx.Timeout(stop_timeout_s, connect=timeout_s)

    async def _call(self, method: str, url: str, answer: type[BaseModel], body: BaseModel | None,
                    timeout: httpx.Timeout) -> BaseModel:
        try:
            response = await self._client().request(
                method, url, json=None if body is None else body.model_dump(mode="json"),
                timeout=timeout)
        except httpx.HTTPError as exc:
            raise LifecycleError(f"the host agent at {url} could not be reached: {exc}", 503) from None
        if response.status_code != 200:
            try:
                message = str(response.json()["error"])
            except (ValueError, KeyError, TypeError):
                message = f"the host agent answered HTTP {response.status_code}"
            status = response.status_code if response.status_code in (400, 404, 409) else 503
            raise LifecycleError(message, status)
        try:
            return answer.model_validate_json(response.content)
        except ValidationError:
            raise LifecycleError(f"the host agent's answer to {url} is malformed", 503) from None

    async def launch(self, agent: str, request: LaunchWorkersRequest) -> LaunchWorkersResponse:
        return await self._call("POST", f"{agent}/launch_workers", LaunchWorkersResponse, request,
                                self._timeout)  # type: ignore[return-value]

    async def stop(self, agent: str, worker_address: str) -> AgentProcess:
        """Returns once the worker has exited (its drain included)."""
        return await self._call("POST", f"{agent}/stop_worker", AgentProcess,
                                StopWorkerRequest(worker_address=worker_address),
                                self._stop_timeout)  # type: ignore[return-value]

    async def status(self, agent: str) -> AgentStatus:
        return await self._call("GET", f"{agent}/list_processes", AgentStatus, None,
                                self._timeout)  # type: ignore[return-value]
