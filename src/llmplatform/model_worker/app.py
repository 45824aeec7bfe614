"""The model worker: one HTTP surface (FastChat's worker routes) around one :class:`LLMBackend`.

The same app serves every backend. The params dict is parsed once here into typed objects and
checked whole before the worker answers (:mod:`.requests`): a refusal is the whole answer, a
FastChat error object with HTTP 200, and errors after that travel inside the stream the same way.
A closed connection aborts the request down to the backend (its generator is closed in
``finally``); ``/worker_abort`` takes the same path (:class:`~.admission.Generation`).

Refusals happen before any work, with an HTTP status (:mod:`.admission`): 429 + Retry-After when
the queue is full, 503 when the engine is dead or the worker is draining. Draining (:func:`drain`,
run when SIGTERM arrives) deregisters from the controller while in-flight requests finish.

A backend rebuilding its engine after a failure answers 503 for a moment and stays registered;
one that failed for good is handled by :mod:`.failure` (``on_backend_failure``: exit in service
mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmplatform.errors import LLMPlatformError
from llmplatform.llm.base import LLMBackend
from llmplatform.llm.embedding import ModelTask
from llmplatform.metrics.common import add_metrics_route
from llmplatform.metrics.worker import WorkerLoad, WorkerMetrics
from llmplatform.model_worker.admission import WorkerState
from llmplatform.model_worker.conv import conv_template_for
from llmplatform.model_worker.embeddings import add_embedding_route, embedding_details
from llmplatform.model_worker.scoring import add_score_route
from llmplatform.model_worker.lora_routes import add_lora_routes
from llmplatform.model_worker.failure import FailureHandler, watch_backend
from llmplatform.model_worker.generation import generate, json_object, streamed, whole
from llmplatform.model_worker.registration import ControllerLink
from llmplatform.model_worker.requests import check_model, model_details_of
from llmplatform.protocol.worker import (AbortRequest, ApplyChatTemplateRequest, ApplyChatTemplateResponse,
                                         CountTokenRequest, ModelDetailsRequest)
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.cluster_secret import ClusterSecretMiddleware, secret_headers
from llmplatform.utils.request_guard import RequestGuard, RequestGuardConfig
from llmplatform.utils.request_id import RequestIdMiddleware

logger = logging.getLogger("llmplatform.worker")


@dataclass(frozen=True)
class WorkerSettings:
    """How the worker presents itself to the cluster.

    ``worker_address`` is the URL others reach this worker at (never a bind-all address); when
    ``None`` registration waits until ``app.state.worker_address`` is set (ephemeral ports).
    """

    worker_address: str | None = None
    controller_address: str | None = "http://127.0.0.1:21001"
    register: bool = True
    limit_worker_concurrency: int = 5
    heartbeat_interval: float = 3.0
    speed: int = 1
    controller_timeout: float = 5.0
    max_queue_len: int = 512
    """Requests that may wait (for a slot or in the backend's queue) before new ones get 429."""
    retry_after: int = 1
    """Seconds a refused (429) client is told to wait, in the Retry-After header."""
    cluster_secret: str | None = None
    """When set, every route but /health and /metrics needs it (X-LLMPlatform-Secret), and the
    worker sends it to the controller."""
    guard: RequestGuardConfig = RequestGuardConfig()
    """What a request must be to reach a route: Host, Origin, JSON body, body size (see
    `request_guard`); `__main__` sets the allowed hosts from the bind address."""
    prepare_grammars: bool = False
    """Build the grammar compiler (structured outputs, forced tool calls) at startup, in a
    thread, rather than on the first request that needs it (about a second of CPU)."""


def create_app(llm: LLMBackend, settings: WorkerSettings, *,
               on_backend_failure: FailureHandler | None = None) -> FastAPI:
    """``on_backend_failure(reason)``: called once the backend has failed for good, after the
    worker left its controller (service mode exits the process there; see :mod:`.failure`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        if settings.prepare_grammars and ModelTask.GENERATE in llm.facts.tasks:
            app.state.grammar_warmup = asyncio.get_running_loop().create_task(
                _prepare_grammars(llm), name="grammar-compiler")
        watcher = asyncio.get_running_loop().create_task(
            watch_backend(app.state, llm, lambda: drain(app), on_backend_failure),
            name="backend-watch")
        client = httpx.AsyncClient(timeout=httpx.Timeout(settings.controller_timeout),
                                   headers=secret_headers(settings.cluster_secret))
        if settings.register and settings.controller_address:
            link = ControllerLink(client, settings.controller_address,
                                  lambda: app.state.worker_address,
                                  lambda: _status(app), heartbeat_interval=settings.heartbeat_interval,
                                  # Leave only when the backend failed for good: a rebuild
                                  # takes seconds, and the worker serves again after it.
                                  is_healthy=lambda: app.state.backend_failure is None)
            app.state.controller_link = link
            link.start()
        try:
            yield
        finally:
            watcher.cancel()
            await drain(app)  # usually begun already, when the shutdown signal came
            await client.aclose()
            await llm.shutdown()

    app = FastAPI(title="llmplatform model worker", lifespan=lifespan)
    app.state.llm = llm
    app.state.settings = settings
    app.state.worker_address = settings.worker_address
    app.state.worker = WorkerState(settings.limit_worker_concurrency, settings.max_queue_len,
                                   settings.retry_after)
    app.state.controller_link = None
    app.state.prefix_cache_resets = 0  # successful /reset_prefix_cache calls
    app.state.backend_failure = None  # why the backend failed for good (.failure)
    app.state.metrics = WorkerMetrics(llm.model_names[0], lambda: WorkerLoad(
        llm.load(), app.state.worker.num_accepted))
    add_metrics_route(app, app.state.metrics.registry)
    app.add_middleware(RequestIdMiddleware, generate=False)
    app.add_middleware(RequestGuard, config=settings.guard)  # Host, Origin, JSON only, body cap
    if settings.cluster_secret:  # outermost: refused before anything else runs
        app.add_middleware(ClusterSecretMiddleware, secret=settings.cluster_secret,
                           exempt_paths=("/health", "/metrics"))
    _add_routes(app)
    return app


def _status(app: FastAPI) -> dict[str, Any]:
    llm: LLMBackend = app.state.llm
    load = llm.load()
    info = llm.backend_info()
    adapters = llm.lora_adapters()
    return {
        # LoRA adapters are models too: the controller routes a request naming one here.
        "model_names": list(llm.model_names) + [adapter.name for adapter in adapters],
        # Ours: each adapter's base model and path, for the gateway's /v1/models.
        "lora_adapters": [{"name": a.name, "parent": a.parent, "root": a.root} for a in adapters],
        "speed": app.state.settings.speed,
        "queue_length": max(app.state.worker.num_accepted, load.num_running + load.num_waiting),
        "num_running": load.num_running,
        "num_waiting": load.num_waiting + max(0, app.state.worker.num_accepted - load.num_running - load.num_waiting),
        "kv_cache_usage": load.kv_cache_usage,
        "backend": llm.backend_name,
        "tasks": [task.value for task in llm.facts.tasks],  # ours: generate, embed, score
        # Batch capacity for least_load: the backend's, unless the worker lets fewer through.
        "max_num_running": min(app.state.settings.limit_worker_concurrency,
                               llm.max_num_running or app.state.settings.limit_worker_concurrency),
        "prefix_cache_queries": load.prefix_cache_queries,
        "prefix_cache_hits": load.prefix_cache_hits,
        # Every emptying of the prefix cache (the reset route, an engine rebuilt after a
        # failure): cache_aware dispatch forgets what it believed this worker holds when it moves.
        "prefix_cache_resets": (app.state.prefix_cache_resets + (load.num_engine_restarts or 0)
                                if load.prefix_cache_queries is not None else None),
        # Ours, so that tests and operators can see every request's resources come back:
        # accepted requests, concurrency slots held, free KV blocks (paged backend).
        "num_accepted": app.state.worker.num_accepted,
        "num_slots_in_use": app.state.worker.num_in_slot,
        "limit_worker_concurrency": app.state.worker.limit,
        "num_free_kv_blocks": load.num_free_kv_blocks,
        "num_kv_blocks": load.num_kv_blocks,
        # Ours: the parallel layout (every rank holds num_kv_blocks blocks of its KV heads).
        "tensor_parallel_size": info.tensor_parallel_size,
        "num_kv_heads_per_rank": info.num_kv_heads_per_rank,
    }


async def _prepare_grammars(llm: LLMBackend) -> None:
    try:
        await llm.grammar_compiler()
    except Exception:  # the first structured request will try again and report it
        logger.warning(
            "could not prepare the grammar compiler", exc_info=True)


async def drain(app: FastAPI) -> None:
    """Begin a graceful shutdown: new generations get 503, /health answers 503, and the worker
    leaves its controller so no more work is routed here. In-flight requests carry on.
    Idempotent (the shutdown signal and the lifespan's end both call it)."""
    app.state.worker.draining = True
    link: ControllerLink | None = app.state.controller_link
    if link is not None:
        await link.leave()


async def _json_body(request: Request, model: type[BaseModel]) -> Any:
    return parse_json_body(model, await request.body())


def _error_response(exc: LLMPlatformError) -> JSONResponse:
    return JSONResponse({"text": exc.message, "error_code": exc.error_code},
                        status_code=exc.http_status)


def _add_routes(app: FastAPI) -> None:
    llm: LLMBackend = app.state.llm

    @app.post("/worker_generate_stream")
    async def worker_generate_stream(request: Request) -> Response:
        # As FastChat's workers answer: a refusal's error object is the whole stream, with HTTP 200.
        return await generate(app, request, refuse=Response, answer=streamed)

    @app.post("/worker_generate")
    async def worker_generate(request: Request) -> Response:
        return await generate(app, request, refuse=json_object, answer=whole)

    add_embedding_route(app, _json_body)
    add_score_route(app, _json_body)
    add_lora_routes(app, _json_body, _error_response)

    @app.post("/worker_get_status")
    async def worker_get_status() -> dict[str, Any]:
        return _status(app)

    @app.post("/count_token")
    async def count_token(request: Request) -> Response:
        try:
            body = await _json_body(request, CountTokenRequest)
            return JSONResponse({"count": await llm.count_tokens(body.prompt), "error_code": 0})
        except LLMPlatformError as exc:
            return _error_response(exc)

    @app.post("/model_details")
    async def model_details(request: Request) -> Response:
        try:
            body = await _json_body(request, ModelDetailsRequest)
            check_model(llm, body.model)
        except LLMPlatformError as exc:
            return _error_response(exc)
        # `params`: the params-dict additions this worker understands beyond FastChat's, so a
        # gateway can send one request where a stock worker needs a count or a render first.
        # `tool_call_parser` (our addition): the syntax this model writes tool calls in; the
        # gateway forces and reads calls in it. Absent: this model serves no tools.
        # `tasks` and `embedding` (ours): what the model serves (model_worker.embeddings).
        return JSONResponse({**model_details_of(llm), **embedding_details(llm)})

    @app.post("/worker_get_conv_template")
    async def worker_get_conv_template() -> dict[str, Any]:
        if getattr(app.state, "conv", None) is None:
            app.state.conv = await asyncio.to_thread(
                conv_template_for, lambda m: llm.apply_chat_template_sync(m, True),
                llm.model_names[0], list(llm.facts.eos_token_ids))
        return {"conv": app.state.conv}

    @app.post("/worker_apply_chat_template")
    async def worker_apply_chat_template(request: Request) -> Response:
        try:
            body = await _json_body(request, ApplyChatTemplateRequest)
            check_model(llm, body.model)
            extra = dict(body.chat_template_kwargs or {})
            if body.tools:
                extra["tools"] = body.tools
            prompt = await llm.apply_chat_template(body.messages, body.add_generation_prompt, **extra)
            count = await llm.count_tokens(prompt)
        except LLMPlatformError as exc:
            return _error_response(exc)
        return JSONResponse(ApplyChatTemplateResponse(
            prompt=prompt, prompt_tokens=count, context_length=llm.context_length).model_dump())

    @app.post("/worker_abort")
    async def worker_abort(request: Request) -> Response:
        """For FastChat peers and operators: the request's stream closes as if its client had
        hung up (:class:`Generation`), after a last frame that says ``abort``. Ours close the
        stream itself."""
        try:
            body = await _json_body(request, AbortRequest)
        except LLMPlatformError as exc:
            return _error_response(exc)
        generation = app.state.worker.generations.get(body.request_id)
        if generation is not None:
            generation.abort()
        return JSONResponse({"aborted": generation is not None})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        """Forget the backend's cached prompt prefixes; ``success`` is False for a backend that
        has no prefix cache (``hf``)."""
        success = await llm.reset_prefix_cache()
        if success:
            app.state.prefix_cache_resets += 1
            logger.info("prefix cache reset")
        return {"success": success, "model_names": list(llm.model_names)}

    @app.get("/health")
    async def health() -> Response:
        if app.state.worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if llm.is_healthy():
            return JSONResponse({"status": "ok", "models": list(llm.model_names)})
        if app.state.backend_failure is None:  # e.g. rebuilding its engine after a failure
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "dead", "reason": app.state.backend_failure}, status_code=503)
