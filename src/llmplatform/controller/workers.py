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
from llmplatform.protocol.worker import error_chunk
from llmplatform.utils.peer_text import is_known_error_code, safe_peer_text

logger = logging.getLogger("llmplatform.controller")


class WorkerUnreachable(Exception):
    """A worker's `/worker_get_status` failed or returned something unusable. The message is a
    short reason of ours (an exception type, an HTTP status), never what the peer sent."""


class WorkerNotListening(WorkerUnreachable):
    """Nothing accepted the connection (refused, unreachable, or no answer to the connect):
    unlike an answer that is wrong, this may be a worker that is not listening *yet*."""


MAX_STATUS_BYTES = 64 * 1024
"""The most of a `/worker_get_status` answer read; a status is a few hundred bytes."""


async def fetch_worker_status(
    client: httpx.AsyncClient, worker_name: str, timeout: float
) -> WorkerStatus:
    """POST {worker}/worker_get_status, all of it within `timeout` seconds; WorkerUnreachable
    (WorkerNotListening when no connection was made) on any failure."""
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", worker_name + "/worker_get_status", timeout=timeout) as response:
                if response.status_code != 200:
                    raise WorkerUnreachable(f"it answered HTTP {response.status_code}")
                body = await _read_at_most(response, MAX_STATUS_BYTES)
                if body is None:
                    raise WorkerUnreachable(f"its status is over {MAX_STATUS_BYTES} bytes")
        return WorkerStatus.model_validate_json(body)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise WorkerNotListening(f"no connection ({type(exc).__name__})") from None
    except TimeoutError:
        raise WorkerUnreachable(f"no answer within {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise WorkerUnreachable(f"no answer ({type(exc).__name__})") from None
    except ValueError:  # not JSON, or not a status (pydantic's ValidationError is a ValueError)
        raise WorkerUnreachable("its answer is not a worker status") from None


async def _read_at_most(response: httpx.Response, limit: int) -> bytes | None:
    """The body, or None once it is over `limit` bytes (the rest is not read)."""
    body = bytearray()
    async for data in response.aiter_bytes():
        body += data
        if len(body) > limit:
            return None
    return bytes(body)


MAX_FRAME_BYTES = 16 * 1024 * 1024
"""The longest stream frame relayed (a frame carries all the text so far)."""


def _frame_object(frame: bytes) -> dict[str, Any] | None:
    try:
        chunk = json.loads(frame)
    except (ValueError, UnicodeDecodeError):
        return None
    return chunk if isinstance(chunk, dict) else None


def _is_output(chunk: dict[str, Any]) -> bool:
    code = chunk.get("error_code", 0)
    return code == 0 and not isinstance(code, bool)


def _safe_error_chunk(chunk: dict[str, Any] | None) -> bytes | None:
    """A worker's well-formed FastChat error with its text cut short (utils.peer_text); None
    for anything else, which is not shown."""
    if chunk is None:
        return None
    code, text = chunk.get("error_code"), chunk.get("text")
    if not is_known_error_code(code) or not isinstance(text, str):
        return None
    return error_chunk(safe_peer_text(text), code)


async def relay_stream(
    client: httpx.AsyncClient, url: str, params: dict[str, Any], timeout: httpx.Timeout
) -> AsyncIterator[bytes]:
    """Yield the worker's NUL-delimited stream frame by frame.

    Whole frames mean a worker dying mid-stream never leaves the consumer holding half a JSON
    object: the partial tail is dropped and one error frame follows instead. An output frame is
    passed on as the worker sent it once it parses as a JSON object; a worker's error frame (or
    non-200 answer) keeps a short text only when it is a well-formed FastChat error
    (utils.peer_text); anything else ends the stream with an error frame of ours, never with the
    worker's bytes. Closing this generator (client disconnect) closes the upstream request,
    which is how the worker learns to abort.
    """
    pending = b""
    invalid = error_chunk("the worker answered with an invalid response", ErrorCode.INTERNAL_ERROR)
    try:
        async with client.stream("POST", url, json=params, timeout=timeout) as response:
            if response.status_code != 200:
                client_error = 400 <= response.status_code < 500
                code = ErrorCode.VALIDATION_TYPE_ERROR if client_error else ErrorCode.INTERNAL_ERROR
                if response.status_code == 429:  # a full worker queue: "try again later"
                    code = ErrorCode.ENGINE_OVERLOADED
                body = await _read_at_most(response, MAX_STATUS_BYTES)
                shown = _safe_error_chunk(_frame_object(body.rstrip(b"\0"))) if body else None
                yield shown or error_chunk(
                    f"the worker answered with an invalid response (HTTP {response.status_code})", code
                )
                return
            async for data in response.aiter_bytes():
                pending += data
                *frames, pending = pending.split(b"\0")
                for frame in frames:
                    if not frame.strip():
                        continue
                    chunk = _frame_object(frame)
                    if chunk is not None and _is_output(chunk):
                        yield frame + b"\0"
                        continue
                    shown = _safe_error_chunk(chunk)
                    if shown is None:
                        logger.warning("the worker at %s sent an invalid stream frame; stream ended", url)
                    yield shown or invalid
                    return
                if len(pending) > MAX_FRAME_BYTES:
                    logger.warning("the worker at %s sent a frame over %d bytes; stream ended", url,
                                   MAX_FRAME_BYTES)
                    yield invalid
                    return
        if pending.strip():  # an unterminated last object
            chunk = _frame_object(pending)
            if chunk is not None and _is_output(chunk):
                yield pending + b"\0"
            else:
                yield _safe_error_chunk(chunk) or invalid
    except httpx.HTTPError as exc:
        logger.warning("stream from %s failed: %s: %s", url, type(exc).__name__, exc)
        yield error_chunk(
            f"the worker failed or timed out ({type(exc).__name__})",
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
        if isinstance(result, WorkerStatus):
            # Removed or re-registered meanwhile: the poll is no longer news (update_status
            # writes only over the registration that was polled).
            registry.update_status(worker.worker_name, result, worker.generation)


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
