"""The Cluster tab: a read-only view of the workers the controller knows.

Reads `GET /list_workers` (ours): the live workers, and those `llmplatform serve` left down
after a crash loop, with the reason and when it retries them. A stock FastChat controller has no such route; then the view
falls back to `POST /list_models` and shows the models without per-worker facts.

The table names every worker's address and load, which is the gateway's business: with admin
keys configured (`WebUISettings.admin_keys`, the gateway's `--admin-api-keys`, else its
`--api-keys`), `snapshot` serves it only to a caller presenting one of them, the rule of the
gateway's /v1/admin routes. Without any key configured the tab is open, as /v1/admin is then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from llmplatform.protocol.controller import (
    DownWorker,
    ListModelsResponse,
    ListWorkersResponse,
    WorkerDescription,
)
from llmplatform.utils.api_keys import KeySet
from llmplatform.utils.cluster_secret import secret_headers
from llmplatform.webui.settings import WebUISettings

logger = logging.getLogger("llmplatform.webui")

COLUMNS = [
    "worker", "models", "backend", "queue length", "running", "waiting", "KV-cache usage",
    "prefix-cache hits", "last heartbeat", "state",
]


NEEDS_KEY = "Enter the admin key to see the cluster."


@dataclass(frozen=True)
class ClusterSnapshot:
    rows: list[list[str]]
    """One row per worker, in COLUMNS order, formatted for display."""
    summary: str
    """One Markdown line above the table: counts, or why there is nothing to show."""


def _dash(value: object | None) -> str:
    return "-" if value is None else str(value)


def prefix_cache_hits(worker: WorkerDescription) -> str:
    """The share of prompt tokens the worker found in its prefix cache since it started, and of
    how many; "-" for a worker without one (hf, stock FastChat) or before its first prompt."""
    queries, hits = worker.prefix_cache_queries, worker.prefix_cache_hits
    if not queries or hits is None:
        return "-"
    return f"{hits / queries:.1%} of {queries:,} tokens"


def worker_row(worker: WorkerDescription) -> list[str]:
    usage = "-" if worker.kv_cache_usage is None else f"{worker.kv_cache_usage:.1%}"
    return [
        worker.worker_name,
        ", ".join(worker.model_names),
        _dash(worker.backend),
        str(worker.queue_length),
        _dash(worker.num_running),
        _dash(worker.num_waiting),
        usage,
        prefix_cache_hits(worker),
        f"{worker.last_heartbeat_age_s:.1f} s ago",
        "up",
    ]


def down_row(worker: DownWorker) -> list[str]:
    """A worker its supervisor left down after a crash loop: why, and when it is retried."""
    retry = ("retrying now" if worker.retry_in_s == 0 else "no retry planned"
             if worker.retry_in_s is None else f"retry in {worker.retry_in_s:.0f} s")
    name = f"{worker.worker_name} ({worker.service})" if worker.service else worker.worker_name
    return ([name, ", ".join(worker.model_names) or "-"] + ["-"] * (len(COLUMNS) - 3)
            + [f"DOWN for {worker.down_for_s:.0f} s: {worker.reason}; {retry}"])


class ClusterView:
    """Fetches and formats the controller's view; one shared httpx client."""

    def __init__(self, settings: WebUISettings) -> None:
        self.controller_address = settings.controller_address
        self._admin_keys = KeySet(settings.admin_keys)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.controller_timeout),
            headers=secret_headers(settings.cluster_secret),
        )

    async def close(self) -> None:
        await self._client.aclose()

    @property
    def needs_key(self) -> bool:
        return bool(self._admin_keys)

    def admits(self, presented_key: str | None) -> bool:
        """Whether `presented_key` opens the view: one of the admin keys (compared in constant
        time with each of them, as the gateway compares them), or anything when none is
        configured. No key is the empty one, which no configured key is."""
        if not self._admin_keys:
            return True
        return self._admin_keys.matches((presented_key or "").strip())

    async def snapshot(self, presented_key: str | None = None) -> ClusterSnapshot:
        if not self.admits(presented_key):
            return ClusterSnapshot([], NEEDS_KEY)
        if self.controller_address is None:
            return ClusterSnapshot([], "No controller address configured (`--controller-address`).")
        base = self.controller_address
        try:
            response = await self._client.get(base + "/list_workers")
            if response.status_code in (404, 405):  # a stock FastChat controller
                return await self._models_only()
            response.raise_for_status()
            listing = ListWorkersResponse.model_validate(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("cluster view: %s: %s", type(exc).__name__, exc)
            return ClusterSnapshot([], f"Cannot read the controller at {base}: {_reason(exc)}")
        workers, down = listing.workers, listing.down_workers
        models = sorted({name for w in workers for name in w.model_names})
        summary = (
            f"**{len(workers)}** live worker(s) at controller {base}; "
            f"models: {', '.join(models) if models else 'none'}."
        )
        if down:
            summary += f" **{len(down)}** left down after crash loops (see the table)."
        return ClusterSnapshot([worker_row(w) for w in workers] + [down_row(w) for w in down],
                               summary)

    async def _models_only(self) -> ClusterSnapshot:
        base = self.controller_address
        response = await self._client.post(f"{base}/list_models")
        response.raise_for_status()
        models = ListModelsResponse.model_validate(response.json()).models
        return ClusterSnapshot(
            [],
            f"The controller at {base} does not list workers (no `/list_workers`); "
            f"models: {', '.join(models) if models else 'none'}.",
        )


def _reason(exc: Exception) -> str:
    """What the page says went wrong: a status or a kind of failure, never what the controller
    (or whatever answers at its address) said; the log has that."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, httpx.TransportError):
        return "cannot connect"
    return "unreadable answer"
