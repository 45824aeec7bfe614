"""The gateway's side of the worker protocol: the controller and the workers, over HTTP.

One :class:`WorkerClient` per app, around the app's one `httpx.AsyncClient` (the controller's
calls are controller_client.py's, which this client routes through); the generation
streams and embeddings calls, every request's hot path, go through a lean HTTP/1.1 pool of their
own (worker_stream.py).
Every failure comes out typed (``worker_wire.py``: the frames and the errors): an unreachable
peer is 503, a silent one 504, a worker's FastChat error code keeps its meaning.

Prompts: our workers render, count and size them; for a stock FastChat worker the gateway does
it (fastchat_peer.py, with this client's `/worker_apply_chat_template`, `/worker_get_conv_template`,
`/count_token`, `/model_details`; what is learnt once per worker is kept in worker_details.py).

Which worker: with `--routing local` the gateway's router answers (llmplatform.routing, kept
read by worker_routing.py) and the controller is asked only for what it cannot answer; with
`--routing controller`, for every request (`/get_worker_address`, FastChat's way).

Failures are typed by what they allow (failover.py's :func:`with_failover` builds on it): a worker that could
not take the request before generating anything (unreachable, closed the connection before
answering, 503 from a dead or draining worker: :class:`WorkerUnavailableError`; 429 from a full
queue: ``EngineOverloadedError`` with ``retry_after``) may be replaced by another worker serving
the model; a worker that fails after the first chunk cannot (the client already has part of the
answer) and the stream ends with an :class:`UpstreamError` (502).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from llmplatform.conversation import ConvTemplate
from llmplatform.openai_api.controller_client import ControllerClient
from llmplatform.openai_api.errors import UpstreamError, error_from_http
from llmplatform.openai_api.worker_routing import RouteRequest, RouteSource
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.worker_details import ModelDetails, WorkerDetails
from llmplatform.openai_api.worker_stream import WorkerStreamClient
from llmplatform.openai_api.worker_wire import (
    ACCEPTED,
    Accepted,
    NulFrameDecoder,
    WorkerUnavailableError,
    has_error_code,
    parse_chunk,
    transport_errors,
    worker_http_error,
)
from llmplatform.protocol.controller import ListWorkersResponse
from llmplatform.protocol.worker import ACCEPTED_HEADER, ApplyChatTemplateResponse, WorkerChunk
from llmplatform.routing.cache_aware import NO_HINT
from llmplatform.routing.policies import DispatchMethod
from llmplatform.routing.router import Router
from llmplatform.utils.cluster_secret import secret_headers

logger = logging.getLogger("llmplatform.openai_api")

MAX_WORKER_CONNECTIONS = 1024
"""Connections to workers at once: every streamed choice holds one for its whole life."""


class WorkerClient:
    def __init__(
        self,
        http: httpx.AsyncClient,
        settings: GatewaySettings,
        *,
        routes: Router | None = None,
        on_route: Callable[[RouteSource], None] | None = None,
        on_decision: Callable[[str, str], None] | None = None,
    ) -> None:
        self._http = http
        self._settings = settings
        # None: every request asks the controller (--routing controller).
        self._routes = routes
        self._on_route = on_route
        self._on_decision = on_decision  # (policy, reason) of each pick the table made
        self._worker_timeout = httpx.Timeout(settings.worker_timeout, connect=settings.connect_timeout)
        self._controller = ControllerClient(http, settings)
        self._details = WorkerDetails(self._post_json)
        self._streams: WorkerStreamClient | None = None  # generation streams and embeddings calls

    # ---- plumbing ----------------------------------------------------------------------------

    async def _post(self, url: str, payload: Any) -> httpx.Response:
        timeout = self._worker_timeout
        with transport_errors("worker", url, timeout.read or 0.0):
            return await self._http.post(url, json=payload, timeout=timeout)

    async def _post_json(self, url: str, payload: Any) -> Any:
        response = await self._post(url, payload)
        if response.status_code != 200:
            raise worker_http_error(response.status_code, response.headers, response.content,
                                    f"The worker at {url}")
        try:
            return response.json()
        except ValueError:
            raise UpstreamError(f"The worker at {url} answered with malformed JSON.") from None

    # ---- controller (controller_client.py) and routing ------------------------------------------

    async def list_models(self) -> list[str]:
        return await self._controller.list_models()

    async def list_workers(self) -> ListWorkersResponse | None:
        return await self._controller.list_workers()

    async def worker_address(self, model: str, exclude: Sequence[str] = (),
                             route: RouteRequest | None = None) -> str:
        """The base URL of a live worker serving `model`, other than those in `exclude`;
        ModelNotFoundError or NoWorkerError. `route`: what the request offers a cache_aware
        policy (its prompt, its session); without it, such a policy ranks by load.

        From the routing table when it has a candidate (no round trip), else from the controller.
        The pick and its reason are logged at debug level, with the request's id.
        """
        if self._routes is not None:
            # Hashing the prompt is for cache_aware only.
            cache_aware = route is not None and self._routes.method is DispatchMethod.CACHE_AWARE
            decision = self._routes.decide(model, exclude, route.hint if cache_aware else NO_HINT)
            if decision is not None:
                self._note_route(RouteSource.TABLE)
                method = self._routes.method.value if self._routes.method else "unknown"
                if self._on_decision is not None:
                    self._on_decision(method, decision.reason.value)
                logger.debug("routed %s to %s by the table (%s: %s, %d prompt characters "
                             "believed cached)", model, decision.worker.worker_name, method,
                             decision.reason.value, decision.matched_chars)
                return decision.worker.worker_name
        self._note_route(RouteSource.CONTROLLER)
        return await self.controller_worker_address(model, exclude, route)

    def forget_model(self, model: str) -> None:
        """A model taken away on purpose is unknown again (``ControllerClient.forget_model``)."""
        self._controller.forget_model(model)

    def worker_failed(self, address: str) -> None:
        """`address` could not take a request: the table skips it until its next read."""
        if self._routes is not None:
            self._routes.mark_down(address)

    def _note_route(self, source: RouteSource) -> None:
        if self._on_route is not None:
            self._on_route(source)

    async def controller_worker_address(self, model: str, exclude: Sequence[str] = (),
                                        route: RouteRequest | None = None) -> str:
        return await self._controller.worker_address(model, exclude, route)

    async def worker_addresses(self, model: str) -> list[str]:
        """Every live worker serving `model`, for an admin action that must reach them all.

        From the controller's `/list_workers` (ours). A stock FastChat controller only answers
        "which worker should serve the next request" (`/get_worker_address`): then this is the
        one worker it picks, and with several workers per model an admin has to call each
        worker's own route. ModelNotFoundError or NoWorkerError as for `worker_address`.
        """
        listing = await self.list_workers()
        if listing is not None:
            addresses = [w.worker_name for w in listing.workers if model in w.model_names]
            if addresses:
                return addresses
        return [await self.worker_address(model)]  # none listed: the controller's 404 or 503

    # ---- admin -------------------------------------------------------------------------------

    async def reset_prefix_cache(self, address: str) -> bool:
        """`POST /reset_prefix_cache` on one worker: True once its prefix cache is empty, False
        when it has none (an `hf` backend, or a stock FastChat worker without the route)."""
        url = f"{address}/reset_prefix_cache"
        response = await self._post(url, None)
        if response.status_code == 404 and not has_error_code(response.content):
            return False
        if response.status_code != 200:
            raise error_from_http(response.status_code, response.content, f"The worker at {url}")
        try:
            data = response.json()
        except ValueError:
            raise UpstreamError(f"The worker at {url} answered with malformed JSON.") from None
        if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
            raise UpstreamError(f"The worker at {url} answered with an invalid response (no result).")
        return data["success"]

    async def lora_adapter(self, address: str, path: str, payload: dict[str, str]) -> dict[str, Any]:
        """``/worker_load_lora_adapter`` or ``/worker_unload_lora_adapter`` (``path``) on one
        worker (ours, ``model_worker.lora_routes``): its answer, or its refusal typed."""
        url = f"{address}{path}"
        response = await self._post(url, payload)
        if response.status_code != 200:
            raise error_from_http(response.status_code, response.content, f"The worker at {url}")
        try:
            data = response.json()
        except ValueError:
            raise UpstreamError(f"The worker at {url} answered with malformed JSON.") from None
        if not isinstance(data, dict):
            raise UpstreamError(f"The worker at {url} answered with an invalid response.")
        return data

    # ---- prompts -----------------------------------------------------------------------------

    async def apply_chat_template(self, address: str, model: str, messages: Sequence[Mapping[str, Any]],
                                  tools: Sequence[Mapping[str, Any]] | None = None,
                                  chat_template_kwargs: Mapping[str, Any] | None = None,
                                  ) -> tuple[str, int, int] | None:
        """``/worker_apply_chat_template`` (ours): the prompt (with `tools` shown to the model,
        and `chat_template_kwargs` as template variables), its token count and the context
        length; None from a stock FastChat worker, which lacks the route (fastchat_peer.py)."""
        url = f"{address}/worker_apply_chat_template"
        payload: dict[str, Any] = {"model": model, "messages": list(messages), "add_generation_prompt": True}
        if tools:
            payload["tools"] = list(tools)
        if chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(chat_template_kwargs)
        response = await self._post(url, payload)
        if response.status_code == 404 and not has_error_code(response.content):
            return None
        if response.status_code != 200:
            raise worker_http_error(response.status_code, response.headers, response.content,
                                    f"The worker at {url}")
        try:
            rendered = ApplyChatTemplateResponse.model_validate_json(response.content)
        except ValidationError:
            raise UpstreamError(f"The worker at {url} answered with a malformed body.") from None
        return rendered.prompt, rendered.prompt_tokens, rendered.context_length

    async def conv_template(self, address: str, model: str) -> ConvTemplate:
        """A stock worker's FastChat conversation template (kept per worker and model)."""
        return await self._details.conv_template(address, model)

    async def count_tokens(self, address: str, model: str, prompt: str) -> int:
        url = f"{address}/count_token"
        data = await self._post_json(url, {"model": model, "prompt": prompt})
        if isinstance(data, dict) and data.get("error_code"):  # only a known code's text is shown
            raise error_from_http(200, json.dumps(data).encode(), f"The worker at {url}")
        if not isinstance(data, dict) or not isinstance(data.get("count"), int):
            raise UpstreamError(f"The worker at {url} answered with an invalid response (no token count).")
        return data["count"]

    async def context_length(self, address: str, model: str) -> int:
        return (await self.model_details(address, model)).context_length

    async def model_details(self, address: str, model: str) -> ModelDetails:
        """The worker's /model_details, read (cached per worker and model)."""
        return await self._details.model_details(address, model)

    async def post_worker(self, address: str, path: str, payload: Any) -> Any:
        """A worker's JSON answer to ``payload``; its refusals (429, 503) typed as for generation.
        Embeddings come this way, one call per client request like the generation streams, so
        it takes their pool: httpx's pool scans every open connection on each request and
        release (with 64 requests in flight, ~45% of the gateway's CPU went there)."""
        url = f"{address}{path}"
        try:
            async with self._stream_client().stream(url, payload) as body:
                content = b"".join([chunk async for chunk in body])
        finally:
            self._request_ended(address)
        try:
            return json.loads(content)
        except ValueError:
            raise UpstreamError(f"The worker at {url} answered with malformed JSON.") from None

    # ---- generation --------------------------------------------------------------------------

    async def generate_stream(self, address: str, params: Mapping[str, Any]
                              ) -> AsyncIterator[WorkerChunk | Accepted]:
        """The worker's chunks, in order; errors (in-stream or transport) raise typed errors.
        First :data:`ACCEPTED`, before any chunk, when the worker says it has checked the
        request (``ACCEPTED_HEADER``): its first chunk will be output, not a refusal.

        Before the first chunk a lost worker is a :class:`WorkerUnavailableError` (another may
        be tried); after it, an :class:`UpstreamError`: the answer is incomplete and cannot be
        resumed elsewhere. Closing this generator closes the HTTP stream, which tells the
        worker to abort.
        """
        url = f"{address}/worker_generate_stream"
        started = False
        try:
            async with self._stream_client().stream(url, params) as body:
                if body.headers.get(ACCEPTED_HEADER) == "1":
                    yield ACCEPTED
                decoder = NulFrameDecoder()
                async for data in body:
                    for frame in decoder.feed(data):
                        started = True
                        yield parse_chunk(frame)
                tail = decoder.flush()
                if tail is not None:
                    started = True
                    yield parse_chunk(tail)
        except WorkerUnavailableError as exc:
            if not started:
                raise
            raise UpstreamError(
                f"The worker at {address} stopped in the middle of the response ({exc.message})"
            ) from None
        finally:
            self._request_ended(address)

    def _request_ended(self, address: str) -> None:
        """Tell the routing table (its load estimate between heartbeats)."""
        if self._routes is not None:
            self._routes.request_ended(address)

    @property
    def max_worker_attempts(self) -> int:
        return self._settings.max_worker_attempts

    @property
    def stream_deltas(self) -> bool:
        """Whether generation params ask for delta frames (``stream_deltas``)."""
        return self._settings.worker_stream_deltas

    def _stream_client(self) -> WorkerStreamClient:
        if self._streams is None:  # made in the event loop that will use it
            self._streams = WorkerStreamClient(
                headers=secret_headers(self._settings.cluster_secret),
                connect_timeout=self._settings.connect_timeout,
                read_timeout=self._settings.worker_timeout, max_connections=MAX_WORKER_CONNECTIONS,
                allowed_networks=self._settings.allowed_worker_networks)
        return self._streams

    async def aclose(self) -> None:
        """Close the worker streams' pool (the app closes its httpx client)."""
        if self._streams is not None:
            await self._streams.aclose()
            self._streams = None
