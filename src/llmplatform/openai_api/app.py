"""The gateway's app factory.

`create_app(settings)` builds everything; nothing runs at import time. State on `app.state`:
`settings`, `created` (the model cards' timestamp) and, while the lifespan runs,
`worker_client` (around the app's one `httpx.AsyncClient`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from llmplatform.openai_api.errors import install_exception_handlers
from llmplatform.openai_api.routes import build_router
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.worker_client import WorkerClient

logger = logging.getLogger("llmplatform.openai_api")

# Every streamed choice holds one connection to its worker for its whole life.
_MAX_CONNECTIONS = 1024
_MAX_KEEPALIVE_CONNECTIONS = 64


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(settings.worker_timeout, connect=settings.connect_timeout)
        limits = httpx.Limits(
            max_connections=_MAX_CONNECTIONS, max_keepalive_connections=_MAX_KEEPALIVE_CONNECTIONS
        )
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            client = WorkerClient(http, settings)
            app.state.worker_client = client
            logger.info("gateway up: controller=%s auth=%s", settings.controller_address, bool(settings.api_keys))
            try:
                yield
            finally:
                await client.aclose()

    app = FastAPI(title="llmplatform OpenAI-compatible API", lifespan=lifespan)
    app.state.settings = settings
    app.state.created = int(time.time())
    install_exception_handlers(app)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials,
        )
    app.include_router(build_router())
    return app
