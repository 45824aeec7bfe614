"""The controller's HTTP surface: FastChat's controller routes over a `WorkerRegistry`.

`create_app(config)` builds everything; nothing runs at import time. State lives on
`app.state` (`config`, `registry`, `dispatcher`, and, while the lifespan runs, `http_client`).
The lifespan owns one `httpx.AsyncClient` (status polls, stream proxying) and the background
task that polls quiet workers and expires those that stopped answering.

Client mistakes (malformed JSON, wrong types, an unusable worker URL) are 400 with
`{"error": message}`, never 500. Routes that take no arguments ignore the body entirely,
because FastChat clients post to them with none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from llmplatform.controller.admission import RegistrationRefused, check_worker_address, split_worker_url
from llmplatform.controller.confirmation import Claim, Confirmations
from llmplatform.controller.dispatch import Dispatcher
from llmplatform.controller.down_workers import DownWorkers, add_down_worker_route
from llmplatform.controller.agents import Agents
from llmplatform.controller.lifecycle_routes import add_lifecycle_routes, model_manager, watching
from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.registry import WorkerInfo, WorkerRegistry
from llmplatform.controller.workers import (
    fetch_worker_status,
    relay_stream,
    single_chunk,
    sweep_periodically,
)
from llmplatform.errors import ErrorCode, InvalidRequestError
from llmplatform.metrics.common import add_metrics_route
from llmplatform.metrics.controller import ControllerMetrics
from llmplatform.routing.cache_aware import RouteHint
from llmplatform.routing.policies import RandomSource
from llmplatform.utils.json_body import parse_json_body, read_json_body, validate_body
from llmplatform.utils.request_id import RequestIdMiddleware
from llmplatform.utils.cluster_secret import ClusterSecretMiddleware, secret_headers
from llmplatform.utils.request_guard import RequestGuard
from llmplatform.utils.worker_addresses import CheckedDialTransport, Resolver, resolve_host
from llmplatform.protocol.controller import (
    CacheAwareOptions,
    DeregisterWorkerRequest,
    DeregisterWorkerResponse,
    GetWorkerAddressRequest,
    GetWorkerAddressResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    ListModelsResponse,
    ListWorkersResponse,
    RefreshAllWorkersResponse,
    RegisterWorkerRequest,
    WorkerDescription,
    WorkerStatus,
)
from llmplatform.protocol.worker import error_chunk

logger = logging.getLogger("llmplatform.controller")

M = TypeVar("M", bound=BaseModel)


class BadRequest(Exception):
    """A client mistake; answered with 400 and `{"error": message}`."""


async def _read_json(request: Request) -> Any:
    """The request's JSON body; BadRequest if it is missing or malformed."""
    try:
        return read_json_body(await request.body())
    except InvalidRequestError as exc:
        raise BadRequest(exc.message) from None


def _validate(model: type[M], data: Any) -> M:
    try:
        return validate_body(model, data)
    except InvalidRequestError as exc:
        raise BadRequest(f"invalid {model.__name__}: {exc.message}") from None


async def _parse_body(request: Request, model: type[M]) -> M:
    try:
        return parse_json_body(model, await request.body())
    except InvalidRequestError as exc:
        raise BadRequest(f"invalid {model.__name__}: {exc.message}") from None


class _ParamsEnvelope(BaseModel):
    """The fields of the params dict the controller reads (extra fields ignored)."""

    model: str
    prompt: Any = None
    """The rendered prompt (a string from any gateway; anything else is not matched, and left
    for the worker to judge): what cache_aware matches."""
    cache_salt: Any = None
    """The request's prefix-cache salt (a string; anything else is the worker's to refuse):
    cache_aware matches the prompt in the salt's own trees, as the worker caches it."""


def normalize_worker_name(worker_name: str) -> str:
    """The registry key for a worker URL: stripped, without trailing slashes.

    Applied to registrations and heartbeats alike, so `http://h:1/` and `http://h:1` are one
    worker and `address + "/worker_generate_stream"` never has a double slash.
    """
    return worker_name.strip().rstrip("/")


def validate_worker_url(worker_name: str) -> None:
    """Refuse names that are not plain http(s) base URLs (the form only; addresses and the
    allow-list are checked by `admission.check_worker_address`)."""
    try:
        split_worker_url(worker_name)
    except RegistrationRefused as exc:
        raise BadRequest(str(exc)) from None


# ---- the app ------------------------------------------------------------------------------------


def create_app(
    config: ControllerConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: RandomSource | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    resolve: Resolver | None = None,
) -> FastAPI:
    """Build a controller app. `clock`, `rng`, the HTTP `transport` of every call to workers and
    the host name `resolve`r (worker addresses, see `admission`) are injectable for tests."""
    config = config or ControllerConfig()
    resolve = resolve or (lambda host: resolve_host(host, config.status_timeout))
    registry = WorkerRegistry(heartbeat_expiration=config.heartbeat_expiration, clock=clock)
    dispatcher = Dispatcher(registry, config.dispatch_method, rng or random.Random(),
                            cache_aware=config.cache_aware)
    metrics = ControllerMetrics(registry)
    confirmations = Confirmations(registry, config, metrics)
    down_workers = DownWorkers(clock)
    agents = Agents(clock)
    models = model_manager(config, registry, agents, lambda: app.state.http_client, clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.status_timeout, connect=config.connect_timeout)
        # Every call of this client goes to a worker: a name is resolved, checked like its
        # registration and dialled at the address checked (utils.worker_addresses).
        dial = CheckedDialTransport(transport or httpx.AsyncHTTPTransport(),
                                    allowed_networks=config.allowed_worker_networks,
                                    resolve=resolve, timeout=config.status_timeout)
        async with httpx.AsyncClient(
            timeout=timeout, transport=dial, headers=secret_headers(config.cluster_secret)
        ) as client:
            app.state.http_client = client
            sweeper = asyncio.create_task(
                sweep_periodically(registry, client, config, metrics), name="controller-expiry"
            )
            logger.info(
                "controller up: dispatch=%s heartbeat_expiration=%.1fs",
                config.dispatch_method.value,
                config.heartbeat_expiration,
            )
            try:
                async with watching(models):
                    yield
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
                await confirmations.aclose()

    app = FastAPI(title="llmplatform controller", lifespan=lifespan)
    app.state.config = config
    app.state.registry = registry
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics
    app.state.confirmations = confirmations
    app.state.down_workers = down_workers
    add_metrics_route(app, metrics.registry)

    app.add_middleware(RequestGuard, config=config.guard)  # Host, Origin, JSON only, body cap
    if config.cluster_secret:
        app.add_middleware(
            ClusterSecretMiddleware,
            secret=config.cluster_secret,
            exempt_paths=("/health", "/metrics", "/test_connection"),
        )

    # A gateway's X-Request-Id tags the lines logged while answering it.
    app.add_middleware(RequestIdMiddleware, generate=False)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(RegistrationRefused)
    async def _refused(request: Request, exc: RegistrationRefused) -> JSONResponse:
        logger.warning("refused registration: %s", exc)
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    def client_of(request: Request) -> httpx.AsyncClient:
        return request.app.state.http_client

    @app.post("/register_worker")
    async def register_worker(request: Request) -> JSONResponse:
        body = await _parse_body(request, RegisterWorkerRequest)
        name = normalize_worker_name(body.worker_name)
        # Before the controller dials the announced address (its status poll).
        await check_worker_address(name, config.allowed_worker_networks, resolve, config.status_timeout)
        claim = Claim(name, body.worker_status, body.check_heart_beat, body.multimodal, body.instance_id)
        if await confirmations.register(client_of(request), claim):
            return JSONResponse(None)  # FastChat answers `null`
        # Ours: a stock client reads only the status; nothing is routed to it yet.
        return JSONResponse({"pending": True, "message": f"worker {name} does not answer yet; it "
                             "is routed once its /worker_get_status does"})

    def same_instance(known: WorkerInfo, instance_id: str | None) -> bool:
        # Our workers send the id they registered with on every beat and deregistration; a
        # stock FastChat worker registered without one and sends none. Anything else is another
        # process speaking for this URL.
        return known.instance_id == instance_id

    @app.post("/receive_heart_beat")
    async def receive_heart_beat(request: Request) -> HeartbeatResponse:
        body = await _parse_body(request, HeartbeatRequest)
        name = normalize_worker_name(body.worker_name)
        known = registry.get(name)
        if known is not None and not same_instance(known, body.instance_id):
            # Not a beat of the registered worker. Told it is unknown, the sender will try to
            # register, and be refused while the URL is taken.
            logger.warning("heartbeat for %s from another worker instance; ignored", name)
            return HeartbeatResponse(exist=False)
        exist = registry.heartbeat(
            name,
            body.queue_length,
            num_running=body.num_running,
            num_waiting=body.num_waiting,
            kv_cache_usage=body.kv_cache_usage,
            prefix_cache_queries=body.prefix_cache_queries,
            prefix_cache_hits=body.prefix_cache_hits,
            prefix_cache_resets=body.prefix_cache_resets,
        )
        if not exist:
            logger.info("heartbeat from unknown worker %s; it will be told to register", name)
        return HeartbeatResponse(exist=exist)

    @app.post("/deregister_worker")
    async def deregister_worker(request: Request) -> DeregisterWorkerResponse:
        # Ours: a worker leaving on purpose (shutdown, dead engine) stops being routed to at
        # once instead of after heartbeat_expiration. Stock FastChat workers never call it.
        body = await _parse_body(request, DeregisterWorkerRequest)
        name = normalize_worker_name(body.worker_name)
        withdrawn = confirmations.withdraw(name, body.instance_id)
        known = registry.get(name)
        if known is not None and not same_instance(known, body.instance_id):
            # Not the process that registered: it may not take the registered worker away.
            logger.warning("deregistration of %s by another worker instance; ignored", name)
            return DeregisterWorkerResponse(removed=withdrawn)
        removed = registry.remove(name) or withdrawn
        logger.info("worker %s deregistered%s", name, "" if removed else " (was not registered)")
        return DeregisterWorkerResponse(removed=removed)

    add_down_worker_route(app, registry, down_workers, _parse_body, normalize_worker_name)
    add_lifecycle_routes(app, models, agents, _parse_body)

    @app.post("/refresh_all_workers")
    async def refresh_all_workers(request: Request) -> RefreshAllWorkersResponse:
        client = client_of(request)
        workers = registry.live_workers()
        results = await asyncio.gather(
            *(fetch_worker_status(client, w.worker_name, config.status_timeout) for w in workers),
            return_exceptions=True,
        )
        removed: list[str] = []
        for worker, result in zip(workers, results):
            # Each result speaks only for the registration that was polled: one that left or
            # was replaced while the polls ran is neither brought back nor removed by it.
            if isinstance(result, WorkerStatus):
                registry.update_status(worker.worker_name, result, worker.generation)
            elif registry.remove(worker.worker_name, generation=worker.generation):
                removed.append(worker.worker_name)
                metrics.expiries.inc()
                logger.info("removed unreachable worker %s: %s", worker.worker_name, result)
        expired = registry.expire()
        metrics.expiries.inc(len(expired))
        removed.extend(expired)
        return RefreshAllWorkersResponse(removed=sorted(removed))

    @app.post("/list_models")
    async def list_models() -> ListModelsResponse:
        return ListModelsResponse(models=registry.list_models())

    @app.post("/list_language_models")
    async def list_language_models() -> ListModelsResponse:
        return ListModelsResponse(models=registry.list_models(multimodal=False))

    @app.post("/list_multimodal_models")
    async def list_multimodal_models() -> ListModelsResponse:
        return ListModelsResponse(models=registry.list_models(multimodal=True))

    @app.get("/list_workers")
    async def list_workers() -> ListWorkersResponse:
        # Read-only (ours only, hence GET): the web UI's Cluster tab, and gateways that route
        # locally from it (every fact dispatch ranks by, and the method it ranks with).
        now = clock()
        options = config.cache_aware
        cache_aware = CacheAwareOptions(
            balance_threshold=options.balance_threshold,
            cold_balance_threshold=options.cold_balance_threshold,
            heat_half_life=options.heat_half_life, entry_ttl_s=options.entry_ttl_s,
            max_chunks_per_worker=options.max_chunks_per_worker, max_sessions=options.max_sessions,
        ) if dispatcher.policy.cache_aware is not None else None
        live = registry.live_workers()
        dispatched = dispatcher.dispatched()
        down = down_workers.listed({w.worker_name for w in live})
        return ListWorkersResponse(dispatch_method=dispatcher.method.value, cache_aware=cache_aware,
                                   down_workers=down, workers=[
            WorkerDescription(
                worker_name=w.worker_name, model_names=list(w.model_names), backend=w.backend,
                tasks=list(w.tasks) if w.tasks is not None else None,
                lora_adapters=None if w.lora_adapters is None else list(w.lora_adapters),
                speed=w.speed, queue_length=w.queue_length, num_running=w.num_running,
                num_waiting=w.num_waiting, kv_cache_usage=w.kv_cache_usage,
                last_heartbeat_age_s=max(0.0, now - w.last_heartbeat),
                max_num_running=w.max_num_running, num_dispatched=dispatched.get(w.worker_name, 0),
                prefix_cache_queries=w.prefix_cache_queries, prefix_cache_hits=w.prefix_cache_hits,
                cache_epoch=w.cache_epoch,
            )
            for w in live
        ])

    @app.post("/get_worker_address")
    async def get_worker_address(request: Request) -> GetWorkerAddressResponse:
        metrics.worker_address_requests.inc()
        body = await _parse_body(request, GetWorkerAddressRequest)
        exclude = {normalize_worker_name(name) for name in body.exclude}
        hint = RouteHint(tuple(body.prefix_hashes), body.session)
        decision = dispatcher.decide(body.model, exclude=exclude, hint=hint)
        if decision is None:
            return GetWorkerAddressResponse(address="")
        models.touch(body.model)  # in use: an on-demand model's keep_alive counts from here
        metrics.dispatch_decisions.labels(dispatcher.method.value, decision.reason.value).inc()
        logger.debug("dispatch %s -> %s (%s, %d prompt characters believed cached)", body.model,
                     decision.worker.worker_name, decision.reason.value, decision.matched_chars)
        return GetWorkerAddressResponse(address=decision.worker.worker_name,
                                        reason=decision.reason.value)

    @app.post("/worker_get_status")
    async def worker_get_status() -> JSONResponse:
        status = registry.aggregate_status(dispatcher.dispatched())
        return JSONResponse(status.model_dump(exclude_none=True))

    @app.post("/worker_generate_stream")
    async def worker_generate_stream(request: Request) -> StreamingResponse:
        # The params dict is the worker's contract; the controller only needs `model` and
        # forwards everything else untouched (including fields it does not know).
        raw_params = await _read_json(request)
        params = _validate(_ParamsEnvelope, raw_params)
        prompt = params.prompt if isinstance(params.prompt, str) else None
        salt = params.cache_salt if isinstance(params.cache_salt, str) else None
        hint = (RouteHint.of(prompt, cache_salt=salt) if dispatcher.policy.cache_aware is not None
                else RouteHint())
        decision = dispatcher.decide(params.model, hint=hint)
        picked = decision.worker if decision is not None else None
        if decision is not None:
            metrics.dispatch_decisions.labels(dispatcher.method.value, decision.reason.value).inc()
        if picked is None:
            chunks: AsyncIterator[bytes] = single_chunk(
                error_chunk(
                    f"no worker is serving model {params.model!r}",
                    ErrorCode.CONTROLLER_NO_WORKER,
                )
            )
        else:
            url = picked.worker_name + "/worker_generate_stream"
            timeout = httpx.Timeout(config.stream_read_timeout, connect=config.connect_timeout)
            chunks = relay_stream(client_of(request), url, raw_params, timeout)
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @app.get("/test_connection")
    async def test_connection() -> str:
        return "success"

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
