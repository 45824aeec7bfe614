"""The gateway's routes: /v1 (behind the API-key check), /v1/admin (behind the admin-key check)
and /health."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from llmplatform.errors import LLMPlatformError, ModelNotFoundError
from llmplatform.openai_api.admin import reset_prefix_cache
from llmplatform.openai_api.auth import require_admin_key, require_api_key
from llmplatform.openai_api.chat import create_chat_completion
from llmplatform.openai_api.completions import create_completion
from llmplatform.openai_api.errors import EnvelopeRoute
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.protocol.openai import ModelCard, ModelList


def _client(request: Request) -> WorkerClient:
    return request.app.state.worker_client


async def list_models(request: Request) -> JSONResponse:
    models = await _client(request).list_models()
    created = request.app.state.created
    cards = [ModelCard(id=model, created=created) for model in sorted(models)]
    return JSONResponse(ModelList(data=cards).model_dump())


async def retrieve_model(model: str, request: Request) -> JSONResponse:
    if model not in await _client(request).list_models():
        raise ModelNotFoundError(f"The model '{model}' does not exist.", param="model")
    return JSONResponse(ModelCard(id=model, created=request.app.state.created).model_dump())


async def health(request: Request) -> JSONResponse:
    """200 while the controller answers; 503 otherwise."""
    try:
        models = await _client(request).list_models()
    except LLMPlatformError as exc:
        return JSONResponse({"status": "unavailable", "detail": exc.message}, status_code=503)
    return JSONResponse({"status": "ok", "models": len(models)})


HOT_ROUTES = {"/v1/chat/completions": create_chat_completion, "/v1/completions": create_completion}
"""POST routes the app dispatches before FastAPI's routing (``hot_routes.GatewayApp``); they are
registered below as well, for the OpenAPI schema and as the same handlers."""


def build_router() -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], route_class=EnvelopeRoute)
    v1.add_api_route("/models", list_models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", retrieve_model, methods=["GET"])
    for path, handler in HOT_ROUTES.items():
        v1.add_api_route(path.removeprefix("/v1"), handler, methods=["POST"])
    admin = APIRouter(prefix="/v1/admin", dependencies=[Depends(require_admin_key)],
                      route_class=EnvelopeRoute)
    admin.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    router = APIRouter(route_class=EnvelopeRoute)
    router.include_router(admin)
    router.include_router(v1)
    router.add_api_route("/health", health, methods=["GET"])
    return router
