"""How the controller talks to workers: status polls, the expiry sweep, and stream proxying."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.errors import ErrorCode
from llmplatform.metrics.controller import ControllerMetrics
from llmplatform.protocol.controller import WorkerStatus

logger = logging.getLogger("llmplatform.controller")


class WorkerUnreachable(Exception):
    """A worker's `/worker_get_status` failed or returned something unusable."""


# ---- request parsing ----------------------------------------------------------------------------


async def fetch_worker_status(
    client: httpx.AsyncClient, worker_name: str, timeout: float
) -> WorkerStatus:
    """POST {worker}/worker_get_status; raise WorkerUnreachable on any failure."""
    try:
        response = await client.post(worker_name + "/worker_get_status", timeout=timeout)
        response.raise_for_status()
        return WorkerStatus.model_validate(response.json())
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: bad JSON or ValidationError
        raise WorkerUnreachable(f"{type(exc).__name__}: {exc}") from None


def error_chunk(text: str, error_code: int) -> bytes:
    return json.dumps({"text": text, "error_code": error_code}).encode() + b"\0"


async def relay_stream(
    client: httpx.AsyncClient, url: str, params: dict[str, Any], timeout: httpx.Timeout
) -> AsyncIterator[bytes]:
    """Yield the worker's NUL-delimited stream unchanged, regrouped at NUL boundaries.

    Yielding whole frames means a worker dying mid-stream never leaves the consumer holding
    half a JSON object: the partial tail is dropped and one error frame follows instead.
    Closing this generator (client disconnect) closes the upstream request, which is how the
    worker learns to abort.
    """
    pending = b""
    try:
        async with client.stream("POST", url, json=params, timeout=timeout) as response:
            if response.status_code != 200:
                body = (await response.aread())[:500].decode("utf-8", "replace")
                client_error = 400 <= response.status_code < 500
                code = ErrorCode.VALIDATION_TYPE_ERROR if client_error else ErrorCode.INTERNAL_ERROR
                if response.status_code == 429:  # a full worker queue: "try again later"
                    code = ErrorCode.ENGINE_OVERLOADED
                yield error_chunk(f"worker answered HTTP {response.status_code}: {body}", code)
                return
            async for data in response.aiter_bytes():
                pending += data
                end = pending.rfind(b"\0")
                if end >= 0:
                    yield pending[: end + 1]
                    pending = pending[end + 1 :]
        if pending:
            yield pending  # an unterminated last object: pass it on as the worker sent it
    except httpx.HTTPError as exc:
        logger.warning("stream from %s failed: %s: %s", url, type(exc).__name__, exc)
        yield error_chunk(
            f"worker {url} failed or timed out: {type(exc).__name__}",
            ErrorCode.CONTROLLER_WORKER_TIMEOUT,
        )


async def _poll_quiet_workers(
    registry: WorkerRegistry, client: httpx.AsyncClient, timeout: float
) -> None:
    """Ask workers silent for half the expiration for their status; an answer counts as a beat.

    Stock FastChat workers beat only every 45 s (FastChat expires them after 90 s), far less
    often than our expiration asks, so without this they would be dropped and re-register
    between beats. Our workers beat every few seconds and are never polled. A worker that does
    not answer is left to expire as usual.
    """
    quiet = registry.quiet_workers(registry.heartbeat_expiration / 2)
    results = await asyncio.gather(
        *(fetch_worker_status(client, w.worker_name, timeout) for w in quiet),
        return_exceptions=True,
    )
    for worker, result in zip(quiet, results):
        # Removed or re-registered meanwhile: the poll is no longer news.
        if isinstance(result, WorkerStatus) and registry.get(worker.worker_name) is worker:
            registry.register(
                worker.worker_name,
                result,
                check_heart_beat=worker.check_heart_beat,
                multimodal=worker.multimodal,
                instance_id=worker.instance_id,
            )


async def sweep_periodically(
    registry: WorkerRegistry, client: httpx.AsyncClient, config: ControllerConfig,
    metrics: ControllerMetrics,
) -> None:
    while True:
        await asyncio.sleep(config.effective_expiry_interval)
        try:
            await _poll_quiet_workers(registry, client, config.status_timeout)
            expiration = registry.heartbeat_expiration
            for name in registry.expire():
                metrics.expiries.inc()
                logger.info("expired worker %s (no heartbeat for %.1f s)", name, expiration)
        except Exception:  # keep sweeping: a bug here must not leave dead workers listed
            logger.exception("expiry sweep failed")


async def single_chunk(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk
