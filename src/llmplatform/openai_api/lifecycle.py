"""The model lifecycle on the gateway: `/v1/admin/models` (launch, list, stop) and on-demand
models (started by the first request for them), both over the controller's lifecycle routes
(``controller/lifecycle_routes.py``).

`POST /v1/admin/models` takes a `LaunchModelRequest` and answers 202 with the model's status
(`loading`; `not_loaded` for an on-demand one); `GET /v1/admin/models` lists every model with its
state; `DELETE /v1/admin/models/{name}` answers 202 (`draining`): its workers get no new request
and stop once their in-flight requests are done. Refusals are OpenAI's error envelope: 400 bad
flags or path, 404 unknown model, 409 already exists or does not fit (with what would), 503 no
host agent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from llmplatform.errors import (
    ConflictError,
    InvalidRequestError,
    LLMPlatformError,
    ModelNotFoundError,
    NoWorkerError,
    WorkerTimeoutError,
)
from llmplatform.openai_api.errors import UpstreamError
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.worker_wire import transport_errors
from llmplatform.protocol.lifecycle import (
    LaunchModelRequest,
    ListModelStatesResponse,
    ModelState,
    ModelStatus,
)
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.peer_text import safe_peer_text

_BY_STATUS: dict[int, type[LLMPlatformError]] = {
    400: InvalidRequestError, 404: ModelNotFoundError, 409: ConflictError, 503: NoWorkerError}
POLL_INTERVAL_S = 0.25
"""How often a request waiting for an on-demand model asks whether it is ready."""


class Lifecycle:
    """The controller's lifecycle routes, typed (over the gateway's one HTTP client)."""

    def __init__(self, http: httpx.AsyncClient, settings: GatewaySettings) -> None:
        self._http = http
        self._address = settings.controller_address
        self._timeout = httpx.Timeout(settings.controller_timeout, connect=settings.connect_timeout)
        self.on_demand_timeout = settings.on_demand_timeout

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        url = f"{self._address}{path}"
        with transport_errors("controller", url, self._timeout.read or 0.0):
            response = await self._http.request(method, url, json=body, timeout=self._timeout)
        if response.status_code == 200:
            try:
                return response.json()
            except ValueError:
                raise UpstreamError(f"The controller answered {path} with malformed JSON.") from None
        if response.status_code in (404, 405) and path == "/list_model_states":
            return None  # a controller without the lifecycle routes (stock FastChat)
        try:
            message = safe_peer_text(str(response.json()["error"]))
        except (ValueError, KeyError, TypeError):
            message = f"The controller answered HTTP {response.status_code} to {path}."
        raise _BY_STATUS.get(response.status_code, UpstreamError)(message)

    async def _status(self, path: str, body: Any) -> ModelStatus:
        data = await self._call("POST", path, body)
        try:
            return ModelStatus.model_validate(data)
        except ValidationError:
            raise UpstreamError(f"The controller's {path} answer is malformed.") from None

    async def launch(self, spec: LaunchModelRequest) -> ModelStatus:
        return await self._status("/launch_model", spec.model_dump(mode="json"))

    async def stop(self, name: str) -> ModelStatus:
        return await self._status("/stop_model", {"name": name})

    async def listing(self) -> ListModelStatesResponse:
        """Every model's state and the host agents; empty from a controller without lifecycle
        routes."""
        data = await self._call("GET", "/list_model_states")
        if data is None:
            return ListModelStatesResponse(models=[])
        try:
            return ListModelStatesResponse.model_validate(data)
        except ValidationError:
            raise UpstreamError("The controller's /list_model_states answer is malformed.") from None

    async def states(self) -> list[ModelStatus]:
        return (await self.listing()).models

    async def ensure(self, model: str) -> ModelStatus | None:
        """Start `model` if it is launchable on demand; None if it is not (nor known)."""
        try:
            return await self._status("/ensure_model", {"model": model})
        except ModelNotFoundError:
            return None

    async def wait_ready(self, first: ModelStatus) -> None:
        """Until the model `ensure` answered `first` for is ready; its failure is a 503 saying
        why, and `on_demand_timeout` without it a 504. Polls the listing, not `ensure`: that
        would start a failed model again; one found not loaded (it was being unloaded when the
        request came, and has finished) is started again."""
        deadline = time.monotonic() + self.on_demand_timeout
        status: ModelStatus | None = first
        while True:
            if status is None:
                raise NoWorkerError(f"The model '{first.name}' was stopped while it started.")
            if status.state is ModelState.READY:
                return
            if status.state is ModelState.NOT_LOADED:
                await self.ensure(first.name)
            if status.state is ModelState.FAILED:
                raise NoWorkerError(f"The model '{first.name}' could not be started: {status.reason}")
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(f"The model '{first.name}' did not start within "
                                         f"{self.on_demand_timeout:g} s; try again later.")
            await asyncio.sleep(POLL_INTERVAL_S)
            status = next((s for s in await self.states() if s.name == first.name), None)


def _lifecycle(request: Request) -> Lifecycle:
    return request.app.state.lifecycle


async def launch_model(request: Request) -> JSONResponse:
    spec = parse_json_body(LaunchModelRequest, await request.body())
    status = await _lifecycle(request).launch(spec)
    return JSONResponse(status.model_dump(mode="json"), status_code=202)


async def list_model_states(request: Request) -> JSONResponse:
    listing = await _lifecycle(request).listing()
    return JSONResponse({"object": "list", "data": [s.model_dump(mode="json") for s in listing.models],
                         "hosts": [h.model_dump(mode="json") for h in listing.hosts]})


async def stop_model(name: str, request: Request) -> JSONResponse:
    status = await _lifecycle(request).stop(name)
    return JSONResponse(status.model_dump(mode="json"), status_code=202)
