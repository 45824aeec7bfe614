"""The gateway's metrics and its one log line per request.

``llmplatform:gateway_requests_total{route,model,status}`` counts every HTTP request by the route
template it matched (``/v1/chat/completions``, ``/v1/models/{model:path}``; ``unmatched`` for
unknown paths, so random URLs cannot grow the label set), the model it was for (set by a handler
through :func:`note_model` once the model is known to exist: an unknown name never becomes a
label) and the HTTP status. ``llmplatform:gateway_request_duration_seconds{route,model}`` times
the whole exchange, to the last byte of a stream.
``llmplatform:gateway_routing_decisions_total{source}`` counts worker picks (failover retries
included) by where they came from: ``table`` (the gateway's own, no controller round trip) or
``controller`` (``/get_worker_address``).
``llmplatform:gateway_dispatch_decisions_total{policy,reason}`` counts the picks the gateway's
routing table made, by the controller's dispatch method it ranked with and why
(``routing.cache_aware.Reason``: ``affinity``, ``session``, ``load_override``, ``spread``,
``no_match``, ``no_cache`` for cache_aware, ``load`` otherwise); the controller counts its own picks the same way.

Per tenant (openai_api.tenants), labelled by ``key_id``: a configured key's id (12 hex digits
derived from the key with scrypt, never the key; the first ``MAX_KEY_LABELS`` keys, ``other``
beyond), or ``anonymous`` on a gateway without keys (client addresses never become labels), so
the label set is bounded by the configuration:
``llmplatform:gateway_key_requests_total{key_id}`` (admitted generation and embedding requests),
``llmplatform:gateway_key_prompt_tokens_total{key_id}``,
``llmplatform:gateway_key_completion_tokens_total{key_id}`` (what the workers reported) and
``llmplatform:gateway_key_rejections_total{key_id,limit}`` (429s by ``concurrency``,
``requests`` or ``tokens``).
"""

from __future__ import annotations

import logging
import time

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.metrics.common import PREFIX, REQUEST_BUCKETS, new_registry
from llmplatform.utils.http_protocol import BODY_TIMED_OUT

logger = logging.getLogger("llmplatform.openai_api.access")

_MODEL_KEY = "metrics_model"


def note_model(request: Request, model: str) -> None:
    """Label this request's metrics with ``model`` (call once the model is known to be served)."""
    request.scope.setdefault("state", {})[_MODEL_KEY] = model


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        self.requests = Counter(PREFIX + "gateway_requests", "HTTP requests answered, by route, "
                                "model and status.", ["route", "model", "status"],
                                registry=self.registry)
        self.duration = Histogram(PREFIX + "gateway_request_duration_seconds",
                                  "From a request's arrival to the last byte of its response.",
                                  ["route", "model"], buckets=REQUEST_BUCKETS,
                                  registry=self.registry)
        self.routing_decisions = Counter(PREFIX + "gateway_routing_decisions",
                                         "Workers picked for a request, by where the pick came "
                                         "from: the gateway's routing table or the controller.",
                                         ["source"], registry=self.registry)
        self.dispatch_decisions = Counter(PREFIX + "gateway_dispatch_decisions",
                                          "Workers the gateway's routing table picked, by "
                                          "dispatch method and reason.", ["policy", "reason"],
                                          registry=self.registry)
        self.key_requests = Counter(PREFIX + "gateway_key_requests", "Generation and embedding "
                                    "requests admitted, by API key id.", ["key_id"],
                                    registry=self.registry)
        self.key_prompt_tokens = Counter(PREFIX + "gateway_key_prompt_tokens", "Prompt tokens "
                                         "used, by API key id.", ["key_id"], registry=self.registry)
        self.key_completion_tokens = Counter(PREFIX + "gateway_key_completion_tokens",
                                             "Completion tokens generated, by API key id.",
                                             ["key_id"], registry=self.registry)
        self.key_rejections = Counter(PREFIX + "gateway_key_rejections", "Requests refused with "
                                      "429 by a per-key limit, by API key id and limit.",
                                      ["key_id", "limit"], registry=self.registry)


class GatewayMetricsMiddleware:
    """Counts and times every HTTP exchange and logs one line when it ends."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500  # if the app raises before answering, the server answers 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            if scope.get("state", {}).get(BODY_TIMED_OUT):
                status = 408  # answered by the server's protocol, not the app (http_protocol)
            self._record(scope, status, time.monotonic() - started)

    def _record(self, scope: Scope, status: int, duration: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        model = scope.get("state", {}).get(_MODEL_KEY, "")
        self.metrics.requests.labels(route, model, str(status)).inc()
        self.metrics.duration.labels(route, model).observe(duration)
        if route in ("/health", "/metrics"):
            return  # polled every few seconds: not news
        logger.info("%s %s -> %d in %.3fs%s", scope.get("method", ""), scope.get("path", ""),
                    status, duration, f" model={model}" if model else "")
