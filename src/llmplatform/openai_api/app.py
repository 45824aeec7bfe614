"""The gateway's app factory.

`create_app(settings)` builds everything; nothing runs at import time. State on `app.state`:
`settings`, `created` (the model cards' timestamp) and, while the lifespan runs,
`worker_client` (around the app's one `httpx.AsyncClient`), `lifecycle` (the controller's model
lifecycle routes, over the same client) and, with `--routing local`,
`routing_table` (the gateway's router), kept fresh by a background task the lifespan starts and cancels.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from llmplatform.metrics.common import add_metrics_route
from llmplatform.metrics.gateway import GatewayMetrics, GatewayMetricsMiddleware
from llmplatform.openai_api.auth import ApiKeyMiddleware
from llmplatform.openai_api.batch_runner import BatchRunner
from llmplatform.openai_api.batch_store import BatchStore
from llmplatform.openai_api.errors import error_payload, install_exception_handlers
from llmplatform.openai_api.files import FILES_PATH, UPLOAD_OVERHEAD_BYTES
from llmplatform.openai_api.lifecycle import Lifecycle
from llmplatform.openai_api.limits import RequestBodyMiddleware
from llmplatform.openai_api.messages_errors import AnthropicErrorMiddleware
from llmplatform.openai_api.response_store import ResponseStore
from llmplatform.openai_api.router import build_router
from llmplatform.openai_api.tenants import TenantMiddleware, Tenants
from llmplatform.openai_api.worker_routing import TableRefresher, max_table_age
from llmplatform.openai_api.settings import GatewaySettings, RoutingMode
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.routing.policies import RandomSource
from llmplatform.routing.router import Router
from llmplatform.utils.tasks import in_background
from llmplatform.utils.cluster_secret import secret_headers
from llmplatform.utils.request_guard import RequestGuard, RequestGuardConfig
from llmplatform.utils.worker_addresses import CheckedDialTransport
from llmplatform.utils.request_id import RequestIdMiddleware, tag_outgoing_request

logger = logging.getLogger("llmplatform.openai_api")

# Controller calls, model details, aborts (the generation streams have their own pool).
_MAX_CONNECTIONS = 256
_MAX_KEEPALIVE_CONNECTIONS = 64


def create_app(settings: GatewaySettings | None = None, *, rng: RandomSource | None = None) -> FastAPI:
    """Build a gateway app. `rng` draws the routing table's random picks (lottery, ties);
    injectable so tests can pin which worker a request goes to, as the controller's can."""
    settings = settings or GatewaySettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(settings.worker_timeout, connect=settings.connect_timeout)
        limits = httpx.Limits(
            max_connections=_MAX_CONNECTIONS, max_keepalive_connections=_MAX_KEEPALIVE_CONNECTIONS
        )
        # Every call to the controller and to workers carries the cluster secret, if any.
        headers = secret_headers(settings.cluster_secret)
        # ...and the id of the request it serves (X-Request-Id), for the workers' logs.
        hooks = {"request": [tag_outgoing_request]}
        # Calls to workers (model details, aborts) dial the address checked (worker_addresses).
        dial = CheckedDialTransport(httpx.AsyncHTTPTransport(limits=limits),
                                    allowed_networks=settings.allowed_worker_networks,
                                    timeout=settings.connect_timeout,
                                    exempt_hosts=[httpx.URL(settings.controller_address).host])
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers,
                                     event_hooks=hooks, transport=dial) as http:
            table = (Router(max_age=max_table_age(settings.worker_refresh_interval), rng=rng)
                     if settings.routing is RoutingMode.LOCAL else None)
            decisions = app.state.metrics.routing_decisions
            dispatch = app.state.metrics.dispatch_decisions
            client = WorkerClient(http, settings, routes=table,
                                  on_route=lambda source: decisions.labels(source.value).inc(),
                                  on_decision=lambda policy, reason: dispatch.labels(policy, reason).inc())
            app.state.worker_client = client
            app.state.lifecycle = Lifecycle(http, settings)
            app.state.routing_table = table
            logger.debug("gateway up: controller=%s auth=%s routing=%s", settings.controller_address,
                         bool(settings.api_keys), settings.routing.value)
            if settings.admin_api_keys and not settings.api_keys:
                # Admin keys alone guard /v1/admin only: easy to mistake for a locked gateway.
                logger.warning("/v1 is OPEN: --admin-api-keys guards only /v1/admin; every other "
                               "/v1 route answers anyone who can reach this port. Set --api-keys "
                               "(or LLMPLATFORM_API_KEYS) to require a key there too.")
            runner = BatchRunner(app, app.state.batch_store, app.state.tenants, settings)
            app.state.batch_runner = runner
            async with _refreshing(table, client, settings.worker_refresh_interval), \
                    _running_batches(runner):
                try:
                    yield
                finally:
                    await client.aclose()
                    await app.state.response_store.aclose()
                    await app.state.batch_store.aclose()

    app = FastAPI(title="llmplatform OpenAI-compatible API", lifespan=lifespan)
    app.state.settings = settings
    app.state.created = int(time.time())
    install_exception_handlers(app)
    app.state.metrics = GatewayMetrics()
    app.state.tenants = Tenants(settings, app.state.metrics)
    # Opened on first use: a gateway never asked for a stored response never touches the disk.
    app.state.response_store = ResponseStore(settings.responses_store,
                                             max_age_s=settings.responses_max_age,
                                             max_count=settings.responses_max_count)
    # Files and batches: the database is opened on first use too (or at start, to resume
    # batches, when it exists).
    app.state.batch_store = BatchStore(settings.batches_store, settings.files_dir)
    # Added innermost first: CORS (preflights answered before any key check), then the API key
    # check, then the per-key limits, then the body guard, so an unauthenticated body is never
    # read (nor a request counted against a key that is not one), nor the body of a request a
    # limit refuses.
    app.add_middleware(RequestBodyMiddleware, max_bytes=settings.limits.max_request_bytes,
                       uploads={FILES_PATH: settings.max_upload_bytes + UPLOAD_OVERHEAD_BYTES})
    app.add_middleware(TenantMiddleware, tenants=app.state.tenants)
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys + settings.admin_api_keys)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials,
        )
    if settings.allowed_hosts is not None:
        # The Host check only (DNS rebinding): browsers on listed origins are CORS's to allow,
        # and bodies are the body guard's.
        app.add_middleware(RequestGuard, config=RequestGuardConfig(
            allowed_hosts=settings.allowed_hosts, same_origin_only=False, json_bodies_only=False,
            max_body_bytes=None, render=lambda exc: json.dumps(error_payload(exc)).encode()))
    # Anthropic's envelope and status codes for every refusal on /v1/messages, the ones above
    # included (they answer in OpenAI's first).
    app.add_middleware(AnthropicErrorMiddleware)
    # Outermost: every answer (a refusal by the middlewares above included) is counted, and
    # carries its request id in the header and in every log line about it.
    app.add_middleware(GatewayMetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(RequestIdMiddleware, generate=True)
    add_metrics_route(app, app.state.metrics.registry)
    app.include_router(build_router())
    return app


@contextlib.asynccontextmanager
async def _refreshing(table: Router | None, client: WorkerClient, interval: float
                      ) -> AsyncIterator[None]:
    """Keeps `table` filled from the controller while the block runs (nothing without a table);
    the task is cancelled and awaited on the way out, before the HTTP client closes."""
    if table is None:
        yield
        return
    refresher = TableRefresher(table, client.list_workers, interval=interval)
    async with in_background(refresher.run(), "gateway-routing-refresh"):
        yield


@contextlib.asynccontextmanager
async def _running_batches(runner: BatchRunner) -> AsyncIterator[None]:
    """The batch runner in the background while the block runs; on the way out its lines in
    flight are cancelled (they run again at the next start) before the HTTP client closes."""
    await runner.start()
    try:
        async with in_background(runner.run(), "gateway-batch-runner"):
            yield
    finally:
        await runner.aclose()
