"""The gateway's side of the worker protocol: the controller and the workers, over HTTP.

One :class:`WorkerClient` per app, around the app's one `httpx.AsyncClient`; the generation
streams and embeddings calls, every request's hot path, go through a lean HTTP/1.1 pool of their
own (worker_stream.py).
Every failure comes out typed (``worker_wire.py``: the frames and the errors): an unreachable
peer is 503, a silent one 504, a worker's FastChat error code keeps its meaning.

Chat prompts: our workers render them (`/worker_apply_chat_template`); a stock FastChat worker
answers 404 there, and then the gateway renders FastChat's conversation template itself, as
FastChat's own gateway does (`/worker_get_conv_template`, `/count_token`, `/model_details`; what
is learnt once per worker is kept in worker_details.py).

Which worker: with `--routing local` the gateway's routing table answers (worker_routing.py) and the
controller is asked only for what the table cannot answer; with `--routing controller`, for every
request (`/get_worker_address`, FastChat's way).

Failures are typed by what they allow (failover.py's :func:`with_failover` builds on it): a worker that could
not take the request before generating anything (unreachable, closed the connection before
answering, 503 from a dead or draining worker: :class:`WorkerUnavailableError`; 429 from a full
queue: ``EngineOverloadedError`` with ``retry_after``) may be replaced by another worker serving
the model; a worker that fails after the first chunk cannot (the client already has part of the
answer) and the stream ends with an :class:`UpstreamError` (502).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from llmplatform.conversation import render_chat_prompt
from llmplatform.errors import ModelNotFoundError, NoWorkerError
from llmplatform.openai_api.errors import UpstreamError, error_from_http
from llmplatform.openai_api.worker_routing import RouteRequest, RouteSource, RoutingTable
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.translate import PreparedPrompt
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
from llmplatform.protocol.controller import (
    GetWorkerAddressResponse,
    ListModelsResponse,
    ListWorkersResponse,
)
from llmplatform.protocol.worker import ACCEPTED_HEADER, ApplyChatTemplateResponse, OpenAIMaxTokens, WorkerChunk
from llmplatform.utils.cluster_secret import secret_headers

logger = logging.getLogger("llmplatform.openai_api")

MAX_WORKER_CONNECTIONS = 1024
"""Connections to workers at once: every streamed choice holds one for its whole life."""

_SINGLE_CALL = frozenset({"messages", "openai_max_tokens"})
"""Params additions that let the gateway send a request in one call (see prepare_chat)."""


class WorkerClient:
    def __init__(
        self,
        http: httpx.AsyncClient,
        settings: GatewaySettings,
        *,
        routes: RoutingTable | None = None,
        on_route: Callable[[RouteSource], None] | None = None,
        on_decision: Callable[[str, str], None] | None = None,
    ) -> None:
        self._http = http
        self._settings = settings
        # None: every request asks the controller (--routing controller).
        self._routes = routes
        self._on_route = on_route
        self._on_decision = on_decision  # (policy, reason) of each pick the table made
        self._controller_timeout = httpx.Timeout(settings.controller_timeout, connect=settings.connect_timeout)
        self._worker_timeout = httpx.Timeout(settings.worker_timeout, connect=settings.connect_timeout)
        # Every model name the controller has listed: an empty address for one of these means
        # "no live worker now" (503), for any other name "no such model" (404).
        self._known_models: set[str] = set()
        self._details = WorkerDetails(
            lambda url, payload: self._post_json("worker", url, payload, self._worker_timeout))
        self._background: set[asyncio.Task[None]] = set()
        self._streams: WorkerStreamClient | None = None  # generation streams and embeddings calls

    # ---- plumbing ----------------------------------------------------------------------------

    async def _post(self, peer: str, url: str, payload: Any, timeout: httpx.Timeout) -> httpx.Response:
        with transport_errors(peer, url, timeout.read or 0.0):
            return await self._http.post(url, json=payload, timeout=timeout)

    async def _post_json(self, peer: str, url: str, payload: Any, timeout: httpx.Timeout) -> Any:
        response = await self._post(peer, url, payload, timeout)
        if response.status_code != 200:
            if peer == "controller":
                raise UpstreamError(f"The controller answered HTTP {response.status_code} to {url}.")
            raise worker_http_error(response.status_code, response.headers, response.content,
                                    f"The worker at {url}")
        try:
            return response.json()
        except ValueError:
            raise UpstreamError(f"The {peer} at {url} answered with malformed JSON.") from None

    # ---- controller --------------------------------------------------------------------------

    async def list_models(self) -> list[str]:
        url = f"{self._settings.controller_address}/list_models"
        data = await self._post_json("controller", url, None, self._controller_timeout)
        try:
            models = ListModelsResponse.model_validate(data).models
        except ValidationError:
            raise UpstreamError("The controller's /list_models answer is malformed.") from None
        self._known_models.update(models)
        return models

    async def list_workers(self) -> ListWorkersResponse | None:
        """The controller's live workers (`GET /list_workers`, ours); None when the controller
        has no such route (a stock FastChat controller answers 404 or 405)."""
        url = f"{self._settings.controller_address}/list_workers"
        with transport_errors("controller", url, self._settings.controller_timeout):
            response = await self._http.get(url, timeout=self._controller_timeout)
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

    async def worker_address(self, model: str, exclude: Sequence[str] = (),
                             route: RouteRequest | None = None) -> str:
        """The base URL of a live worker serving `model`, other than those in `exclude`;
        ModelNotFoundError or NoWorkerError. `route`: what the request offers a cache_aware
        policy (its prompt, its session); without it, such a policy ranks by load.

        From the routing table when it has a candidate (no round trip), else from the controller.
        The pick and its reason are logged at debug level, with the request's id.
        """
        if self._routes is not None:
            decision = self._routes.decide(model, exclude, route)
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

    def worker_failed(self, address: str) -> None:
        """`address` could not take a request: the table skips it until its next read."""
        if self._routes is not None:
            self._routes.mark_down(address)

    def _note_route(self, source: RouteSource) -> None:
        if self._on_route is not None:
            self._on_route(source)

    async def controller_worker_address(self, model: str, exclude: Sequence[str] = (),
                                        route: RouteRequest | None = None) -> str:
        """The controller's pick (`POST /get_worker_address`): a worker other than those in
        `exclude`, matched by `route`'s hint under cache_aware (a stock controller ignores
        both); ModelNotFoundError or NoWorkerError."""
        url = f"{self._settings.controller_address}/get_worker_address"
        payload: dict[str, Any] = {"model": model}
        if exclude:
            payload["exclude"] = list(exclude)
        if route is not None:  # the controller's method is not known here: always offered
            hint = route.hint
            if hint.prefix_hashes:
                payload["prefix_hashes"] = list(hint.prefix_hashes)
            if hint.session is not None:
                payload["session"] = hint.session
        data = await self._post_json("controller", url, payload, self._controller_timeout)
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
        response = await self._post("worker", url, None, self._worker_timeout)
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

    # ---- prompts -----------------------------------------------------------------------------

    async def prepare_chat(
        self, address: str, model: str, messages: Sequence[Mapping[str, str]], *, requested: int | None
    ) -> PreparedPrompt:
        """What to send for a chat request. A worker of ours renders, counts and sizes it itself
        (one round trip: the generate call); a stock one needs the render and the count first."""
        budget = OpenAIMaxTokens(requested=requested, default=None, param="messages")
        if _SINGLE_CALL <= (await self.model_details(address, model)).extensions:
            return PreparedPrompt(None, 0, None, messages=[dict(m) for m in messages], budget=budget)
        url = f"{address}/worker_apply_chat_template"
        payload = {"model": model, "messages": list(messages), "add_generation_prompt": True}
        response = await self._post("worker", url, payload, self._worker_timeout)
        if response.status_code == 200:
            try:
                rendered = ApplyChatTemplateResponse.model_validate_json(response.content)
            except ValidationError:
                raise UpstreamError(f"The worker at {url} answered with a malformed body.") from None
            return PreparedPrompt(rendered.prompt, rendered.prompt_tokens, rendered.context_length)
        if response.status_code != 404 or has_error_code(response.content):
            raise worker_http_error(response.status_code, response.headers, response.content,
                                    f"The worker at {url}")
        # A stock FastChat worker: render its conversation template here.
        conv = await self._details.conv_template(address, model)
        prompt = render_chat_prompt(conv, messages)
        prompt_tokens, context_length = await asyncio.gather(
            self.count_tokens(address, model, prompt), self.context_length(address, model)
        )
        return PreparedPrompt(
            prompt,
            prompt_tokens,
            context_length,
            stop=tuple(conv.stop_strings),
            stop_token_ids=conv.stop_token_ids,
        )

    async def prepare_completion(
        self, address: str, model: str, prompt: str, *, requested: int | None, default: int
    ) -> PreparedPrompt:
        if _SINGLE_CALL <= (await self.model_details(address, model)).extensions:
            budget = OpenAIMaxTokens(requested=requested, default=default, param="prompt")
            return PreparedPrompt(prompt, 0, None, budget=budget)
        prompt_tokens, context_length = await asyncio.gather(
            self.count_tokens(address, model, prompt), self.context_length(address, model)
        )
        return PreparedPrompt(prompt, prompt_tokens, context_length)

    async def count_tokens(self, address: str, model: str, prompt: str) -> int:
        url = f"{address}/count_token"
        data = await self._post_json("worker", url, {"model": model, "prompt": prompt}, self._worker_timeout)
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

    def abort_soon(self, address: str, request_id: str) -> None:
        """Best-effort `POST /worker_abort` in the background (a stock worker lacks the route)."""
        task = asyncio.get_running_loop().create_task(self._abort(address, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, address: str, request_id: str) -> None:
        url = f"{address}/worker_abort"
        try:
            await self._http.post(url, json={"request_id": request_id}, timeout=self._settings.abort_timeout)
        except httpx.HTTPError as exc:
            logger.debug("abort of %s at %s failed: %s", request_id, url, exc)

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
        """Let pending aborts finish (bounded), then close the worker streams' pool (the app
        closes its httpx client)."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._settings.abort_timeout)
        if self._streams is not None:
            await self._streams.aclose()
            self._streams = None
