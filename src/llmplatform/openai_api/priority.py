"""Request priorities on the gateway: interactive requests above batch lines.

A worker's engine orders its queues by ``priority`` (vLLM's field, lower first). The gateway
keeps two bands apart: a client's own ``priority`` (chat, completions) must stay below
:data:`BACKGROUND_PRIORITY` (a 400 naming ``priority`` otherwise: clamping would silently change
what the client asked for), and every batch line (openai_api.batch_runner) is sent at
``BACKGROUND_PRIORITY`` plus the line's own ``priority`` if it gives a positive one (to order lines
among themselves), at most :data:`MAX_PRIORITY`. So no interactive request ever waits behind a
batch line in a worker's queue, whatever priorities clients choose.

Every dialect served on the chat path (chat, Responses, Messages) gets a batch line's priority
the same way, in :func:`chat.serve_chat`. A worker that does not announce ``priority`` (a stock
FastChat worker, the hf backend) gets batch lines without one, as interactive requests: the
batch's concurrency cap (``--batch-concurrency``) is then all that holds the batch back.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.auth import batch_owner
from llmplatform.protocol.openai import ChatCompletionRequest, CompletionRequest
from llmplatform.protocol.worker import BACKGROUND_PRIORITY, MAX_PRIORITY

__all__ = ["BACKGROUND_PRIORITY", "check_priority", "scheduled"]

R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


def check_priority(request: Request, priority: int | None) -> None:
    """Refuse an interactive request's priority in the batch band (a batch line may have any)."""
    if priority is not None and priority >= BACKGROUND_PRIORITY and batch_owner(request.scope) is None:
        raise InvalidRequestError(
            f"Invalid value for 'priority': it must be below {BACKGROUND_PRIORITY}; priorities from "
            f"{BACKGROUND_PRIORITY} up are reserved for batch requests (/v1/batches).", param="priority")


def scheduled(request: Request, body: R, announced: frozenset[str]) -> R:
    """`body` as the worker that `announced` these params extensions is to get it: an interactive
    request as it is; a batch line at its place in the batch band, or without a priority for a
    worker that does not schedule by one."""
    if batch_owner(request.scope) is None:
        return body
    if "priority" not in announced:
        return body.model_copy(update={"priority": None})
    own = max(0, body.priority or 0)
    return body.model_copy(update={"priority": min(MAX_PRIORITY, BACKGROUND_PRIORITY + own)})
