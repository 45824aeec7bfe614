"""What every service's ``GET /metrics`` shares: a registry per app, the route, bucket layouts.

Each app owns its own :class:`CollectorRegistry` (never prometheus_client's global one), so
several services in one process (tests, embedded use) never mix or collide. Metric names use
the ``llmplatform:`` prefix the way vLLM uses ``vllm:``; prometheus_client appends ``_total`` to
counters in the exposition, so ``Counter("llmplatform:prompt_tokens")`` is scraped as
``llmplatform:prompt_tokens_total``.
"""

from __future__ import annotations

import prometheus_client
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest

PREFIX = "llmplatform:"

# Latency buckets (seconds), wide enough for a CPU at one end and a GPU at the other.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                       0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)


def new_registry() -> CollectorRegistry:
    # The per-counter ``*_created`` timestamps double the exposition for no dashboard's benefit.
    prometheus_client.disable_created_metrics()
    return CollectorRegistry(auto_describe=True)


def add_metrics_route(app: FastAPI, registry: CollectorRegistry) -> None:
    """``GET /metrics``: the Prometheus text exposition of ``registry`` (no auth, like /health)."""

    async def metrics() -> Response:
        return Response(generate_latest(registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
