"""The gateway's side of the controller protocol: which models exist, which workers are live,
and (with `--routing controller`, or when the routing table has no candidate) which worker
takes a request. Over the app's one `httpx.AsyncClient`; a failure comes out typed
(``worker_wire.transport_errors``: an unreachable controller is 503, a silent one 504)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from llmplatform.errors import ModelNotFoundError, NoWorkerError
from llmplatform.openai_api.errors import UpstreamError
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.worker_routing import RouteRequest
from llmplatform.openai_api.worker_wire import transport_errors
from llmplatform.protocol.controller import (
    GetWorkerAddressResponse,
    ListModelsResponse,
    ListWorkersResponse,
)

logger = logging.getLogger("llmplatform.openai_api")


class ControllerClient:
    def __init__(self, http: httpx.AsyncClient, settings: GatewaySettings) -> None:
        self._http = http
        self._address = settings.controller_address
        self._timeout = httpx.Timeout(settings.controller_timeout, connect=settings.connect_timeout)
        # Every model name the controller has listed: an empty address for one of these means
        # "no live worker now" (503), for any other name "no such model" (404).
        self._known_models: set[str] = set()

    async def _post_json(self, url: str, payload: Any) -> Any:
        with transport_errors("controller", url, self._timeout.read or 0.0):
            response = await self._http.post(url, json=payload, timeout=self._timeout)
        if response.status_code != 200:
            raise UpstreamError(f"The controller answered HTTP {response.status_code} to {url}.")
        try:
            return response.json()
        except ValueError:
            raise UpstreamError(f"The controller at {url} answered with malformed JSON.") from None

    async def list_models(self) -> list[str]:
        url = f"{self._address}/list_models"
        data = await self._post_json(url, None)
        try:
            models = ListModelsResponse.model_validate(data).models
        except ValidationError:
            raise UpstreamError("The controller's /list_models answer is malformed.") from None
        self._known_models.update(models)
        return models

    async def list_workers(self) -> ListWorkersResponse | None:
        """The controller's live workers (`GET /list_workers`, ours); None when the controller
        has no such route (a stock FastChat controller answers 404 or 405)."""
        url = f"{self._address}/list_workers"
        with transport_errors("controller", url, self._timeout.read or 0.0):
            response = await self._http.get(url, timeout=self._timeout)
        if response.status_code in (404, 405):
            return None
        if response.status_code != 200:
            raise UpstreamError(f"The controller answered HTTP {response.status_code} to {url}.")
        try:
            listing = ListWorkersResponse.model_validate_json(response.content)
        except ValidationError:
            raise UpstreamError("The controller's /list_workers answer is malformed.") from None
        self._known_models.update(name for worker in listing.workers for name in worker.model_names)
        return listing

    def forget_model(self, model: str) -> None:
        """`model` was taken away on purpose (an unloaded LoRA adapter): a request for it is a
        404 again, not the 503 of a known model whose workers are all away for a moment."""
        self._known_models.discard(model)

    async def worker_address(self, model: str, exclude: Sequence[str] = (),
                             route: RouteRequest | None = None) -> str:
        """The controller's pick (`POST /get_worker_address`): a worker other than those in
        `exclude`, matched by `route`'s hint under cache_aware (a stock controller ignores
        both); ModelNotFoundError or NoWorkerError."""
        url = f"{self._address}/get_worker_address"
        payload: dict[str, Any] = {"model": model}
        if exclude:
            payload["exclude"] = list(exclude)
        if route is not None:  # the controller's method is not known here: always offered
            hint = route.hint
            if hint.prefix_hashes:
                payload["prefix_hashes"] = list(hint.prefix_hashes)
            if hint.session is not None:
                payload["session"] = hint.session
        data = await self._post_json(url, payload)
        try:
            answer = GetWorkerAddressResponse.model_validate(data)
        except ValidationError:
            raise UpstreamError("The controller's /get_worker_address answer is malformed.") from None
        address = answer.address
        if address:
            self._known_models.add(model)
            logger.debug("routed %s to %s by the controller (%s)", model, address,
                         answer.reason or "no reason given")
            return address.rstrip("/")
        live = await self.list_models()
        if model in live or model in self._known_models:
            raise NoWorkerError(f"No worker is serving the model '{model}' right now; try again later.")
        raise ModelNotFoundError(f"The model '{model}' does not exist.", param="model")
