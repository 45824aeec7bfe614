"""The generation routes, dispatched before FastAPI's own stack.

``POST /v1/chat/completions`` and ``POST /v1/completions`` carry nearly all of a gateway's
traffic, and every millisecond the gateway spends on one is added to the request's time to first
token. FastAPI's per-request work around a handler (matching through the included routers,
solving the router's dependencies, its exception, body-limit and telemetry layers) is not needed
for them. So :class:`GatewayApp` sends these two method-and-path pairs straight to their handlers,
behind the same user middlewares as every other route (request id, metrics, CORS, API keys, body
limit), with the API-key check of the ``/v1`` router and the same error envelope
(:func:`~llmplatform.openai_api.errors.guard`). Everything else, these paths with another method
included, goes through FastAPI as before; the two routes stay registered there too, so the OpenAPI
schema still lists them. With the leaner streamed response (``sse.EventStreamResponse``) and
uvicorn's access line off, this took 0.6 ms off each request's time to first token and 0.7 ms off
the gateway's CPU per request (2.8 to 2.1 ms) on a 2-core machine (paired A/B, 2,000 pairs, a
worker that answers at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from llmplatform.openai_api.auth import require_api_key
from llmplatform.openai_api.errors import Handler, guard


@dataclass(frozen=True)
class HotRoute:
    """What the metrics middleware reads from ``scope["route"]``: the route's path template."""

    path: str
    endpoint: Handler


def _keyed(handler: Handler) -> Handler:
    async def checked(request: Request) -> Any:
        await require_api_key(request)  # what the /v1 router's dependency checks
        return await handler(request)

    return checked


class _HotEndpoints:
    """The innermost app of the hot chain: the route's guarded handler, then its response."""

    def __init__(self, routes: Mapping[str, HotRoute]) -> None:
        self._routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes[scope["path"]]
        scope["route"] = route
        response = await route.endpoint(Request(scope, receive, send))
        await response(scope, receive, send)


class _Dispatch:
    def __init__(self, hot: ASGIApp, default: ASGIApp, paths: frozenset[str]) -> None:
        self._hot = hot
        self._default = default
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._paths:
            await self._hot(scope, receive, send)
        else:
            await self._default(scope, receive, send)


class GatewayApp(FastAPI):
    """A FastAPI app whose ``hot_routes`` (POST path -> handler) skip FastAPI's routing."""

    def __init__(self, *args: Any, hot_routes: Mapping[str, Handler], **kwargs: Any) -> None:
        self._hot_routes = {path: HotRoute(path, guard(_keyed(handler))) for path, handler in hot_routes.items()}
        super().__init__(*args, **kwargs)

    def build_middleware_stack(self) -> ASGIApp:
        default = super().build_middleware_stack()
        hot: ASGIApp = _HotEndpoints(self._hot_routes)
        for cls, args, kwargs in reversed(self.user_middleware):
            hot = cls(hot, *args, **kwargs)
        return _Dispatch(hot, default, frozenset(self._hot_routes))
