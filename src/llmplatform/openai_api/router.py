"""The gateway's routes: /v1 (behind the API-key check), /v1/admin (behind the admin-key check)
and /health.

Every /v1 route, the generation routes included, is a route of the one /v1 router, so whatever
that router carries (the key check, any dependency added to it, the error envelope of
``EnvelopeRoute``) holds for all of them; tests/integration/test_gateway_router.py checks it.

The generation routes were once dispatched ahead of FastAPI's routing, to skip its per-request
work. Measured side by side (``benchmarks/serve.py --systems paged,direct --gateway-pairs 200``,
tiny model, 2 shared cores, FastAPI 0.165), the gateway's added latency per request was a median
1.75 ms (p25 0.83, p75 3.89) with that dispatch and 1.82 ms (p25 1.12, p75 4.41) through this
router; its own work beyond a bare proxy hop 0.81 ms against 0.82 ms. No user would notice the
difference, so there is one path.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from llmplatform.errors import LLMPlatformError, ModelNotFoundError
from llmplatform.openai_api.admin import reset_prefix_cache
from llmplatform.openai_api.auth import require_admin_key, require_api_key
from llmplatform.openai_api.batches import cancel_batch, create_batch, list_batches, retrieve_batch
from llmplatform.openai_api.chat import create_chat_completion
from llmplatform.openai_api.completions import create_completion
from llmplatform.openai_api.embeddings import create_embeddings, model_tasks
from llmplatform.openai_api.scoring import create_rerank, create_score
from llmplatform.openai_api.errors import EnvelopeRoute
from llmplatform.openai_api.files import (create_file, delete_file, list_files, retrieve_file,
                                          retrieve_file_content)
from llmplatform.openai_api.lifecycle import launch_model, list_model_states, stop_model
from llmplatform.openai_api.lora import load_lora_adapter, unload_lora_adapter
from llmplatform.openai_api.messages import count_message_tokens, create_message
from llmplatform.openai_api.responses import (create_response, delete_response, list_input_items,
                                              retrieve_response)
from llmplatform.protocol.lifecycle import ModelState
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.protocol.lora import LoRAAdapterCard
from llmplatform.protocol.openai import ModelCard, ModelList


def _client(request: Request) -> WorkerClient:
    return request.app.state.worker_client


async def list_models(request: Request) -> JSONResponse:
    models = await _client(request).list_models()
    tasks = await model_tasks(_client(request))  # what each serves: generate, embed, score
    adapters = await _lora_adapters(_client(request))
    created = request.app.state.created
    cards = [ModelCard(id=model, created=created, tasks=tasks.get(model),
                       parent=adapters[model].parent if model in adapters else None,
                       root=adapters[model].root if model in adapters else None)
             for model in sorted(models)]
    # Launchable on demand but not running: listed, marked, so clients can pick them.
    waiting = [s.name for s in await request.app.state.lifecycle.states()
               if s.on_demand and s.state is not ModelState.READY and s.name not in models]
    cards += [ModelCard(id=name, created=created, loaded=False) for name in sorted(waiting)]
    return JSONResponse(ModelList(data=cards).model_dump())


async def _lora_adapters(client: WorkerClient) -> dict[str, LoRAAdapterCard]:
    """The LoRA adapters live workers serve, by name (from the controller's listing, ours)."""
    listing = await client.list_workers()
    return {card.name: card for worker in (listing.workers if listing is not None else ())
            for card in worker.lora_adapters or ()}


async def retrieve_model(model: str, request: Request) -> JSONResponse:
    created = request.app.state.created
    if model in await _client(request).list_models():
        adapter = (await _lora_adapters(_client(request))).get(model)
        return JSONResponse(ModelCard(id=model, created=created,
                                      parent=adapter.parent if adapter else None,
                                      root=adapter.root if adapter else None).model_dump())
    if any(s.name == model and s.on_demand for s in await request.app.state.lifecycle.states()):
        return JSONResponse(ModelCard(id=model, created=created, loaded=False).model_dump())
    raise ModelNotFoundError(f"The model '{model}' does not exist.", param="model")


async def health(request: Request) -> JSONResponse:
    """200 while the controller answers ("degraded" while a supervisor keeps a worker down after
    a crash loop: what still serves is served); 503 otherwise. A down worker shows by its
    supervisor's name, models, reason and retry time: not its address (this route is public)."""
    client = _client(request)
    try:
        listing = await client.list_workers()
        if listing is None:  # a stock FastChat controller: no worker list, no down list
            return JSONResponse({"status": "ok", "models": len(await client.list_models())})
    except LLMPlatformError as exc:
        return JSONResponse({"status": "unavailable", "detail": exc.message}, status_code=503)
    models = {name for worker in listing.workers for name in worker.model_names}
    body: dict[str, object] = {"status": "degraded" if listing.down_workers else "ok",
                               "models": len(models)}
    if listing.down_workers:
        body["down_workers"] = [
            {"service": w.service, "models": w.model_names, "reason": w.reason,
             "down_for_s": round(w.down_for_s, 1),
             "retry_in_s": None if w.retry_in_s is None else round(w.retry_in_s, 1)}
            for w in listing.down_workers]
    return JSONResponse(body)


GENERATION_ROUTES = {"/v1/chat/completions": create_chat_completion, "/v1/completions": create_completion,
                     "/v1/messages": create_message, "/v1/responses": create_response}
"""The POST routes that generate (and may stream)."""


def build_router() -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], route_class=EnvelopeRoute)
    v1.add_api_route("/models", list_models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", retrieve_model, methods=["GET"])
    v1.add_api_route("/embeddings", create_embeddings, methods=["POST"])
    v1.add_api_route("/rerank", create_rerank, methods=["POST"])
    v1.add_api_route("/score", create_score, methods=["POST"])
    v1.add_api_route("/messages/count_tokens", count_message_tokens, methods=["POST"])
    for path, handler in GENERATION_ROUTES.items():
        v1.add_api_route(path.removeprefix("/v1"), handler, methods=["POST"])
    # Stored responses (openai_api.responses), each visible to the key that made it only.
    v1.add_api_route("/responses/{response_id}", retrieve_response, methods=["GET"])
    v1.add_api_route("/responses/{response_id}", delete_response, methods=["DELETE"])
    v1.add_api_route("/responses/{response_id}/input_items", list_input_items, methods=["GET"])
    # Files and batches (openai_api.files, openai_api.batches), each visible to its creator only.
    v1.add_api_route("/files", create_file, methods=["POST"])
    v1.add_api_route("/files", list_files, methods=["GET"])
    v1.add_api_route("/files/{file_id}", retrieve_file, methods=["GET"])
    v1.add_api_route("/files/{file_id}", delete_file, methods=["DELETE"])
    v1.add_api_route("/files/{file_id}/content", retrieve_file_content, methods=["GET"])
    v1.add_api_route("/batches", create_batch, methods=["POST"])
    v1.add_api_route("/batches", list_batches, methods=["GET"])
    v1.add_api_route("/batches/{batch_id}", retrieve_batch, methods=["GET"])
    v1.add_api_route("/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])
    # vLLM's paths, on the /v1 router like every /v1 route, and the admin key's besides: what the
    # cluster serves is the operator's choice.
    for path, handler in (("/load_lora_adapter", load_lora_adapter),
                          ("/unload_lora_adapter", unload_lora_adapter)):
        v1.add_api_route(path, handler, methods=["POST"], dependencies=[Depends(require_admin_key)])
    admin = APIRouter(prefix="/v1/admin", dependencies=[Depends(require_admin_key)],
                      route_class=EnvelopeRoute)
    admin.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    admin.add_api_route("/models", launch_model, methods=["POST"])
    admin.add_api_route("/models", list_model_states, methods=["GET"])
    admin.add_api_route("/models/{name:path}", stop_model, methods=["DELETE"])
    # vLLM serves rerank and score at these paths too (Jina's clients post to /v2/rerank).
    scoring = APIRouter(dependencies=[Depends(require_api_key)], route_class=EnvelopeRoute)
    for path, handler in (("/rerank", create_rerank), ("/v2/rerank", create_rerank),
                          ("/score", create_score)):
        scoring.add_api_route(path, handler, methods=["POST"])
    router = APIRouter(route_class=EnvelopeRoute)
    router.include_router(admin)
    router.include_router(v1)
    router.include_router(scoring)
    router.add_api_route("/health", health, methods=["GET"])
    return router
