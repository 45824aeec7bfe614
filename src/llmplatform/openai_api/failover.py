"""Failover: a request that a worker could not take goes to another worker of the model.

Which failures allow it is decided by the wire (``worker_wire.may_try_another_worker``): only
those that happened before the worker generated anything.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from llmplatform.errors import LLMPlatformError, NoWorkerError
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.openai_api.worker_wire import may_try_another_worker

logger = logging.getLogger("llmplatform.openai_api")

T = TypeVar("T")


async def with_failover(
    client: WorkerClient, model: str, attempt: Callable[[str], Awaitable[T]], *, address: str | None = None,
    tried: Sequence[str] = (), last: LLMPlatformError | None = None,
) -> T:
    """``attempt(address)`` on a worker serving `model` (`address` if already picked); when that
    worker cannot take the request (:func:`may_try_another_worker`) it is marked down in the
    routing table and another one is picked (from the table, else by the controller), excluding
    those tried, up to ``max_worker_attempts`` workers in all. When none
    is left, the last worker's error is raised (a 429 keeps its Retry-After). `attempt` must not
    have sent the client anything: it is all or nothing.

    `tried` (with `last`, the error of the last of them) continues a failover begun earlier:
    those workers are excluded and count towards the limit.
    """
    excluded: list[str] = list(tried)
    assert not excluded or last is not None, "a continued failover needs the last error"
    for _ in range(client.max_worker_attempts - len(excluded)):
        if address is None:
            try:
                address = await client.worker_address(model, exclude=excluded)
            except NoWorkerError:
                if last is None:
                    raise
                break
        if address in excluded:  # a stock controller ignores `exclude`: nobody else to ask
            break
        try:
            return await attempt(address)
        except LLMPlatformError as exc:
            if not may_try_another_worker(exc):
                raise
            logger.warning("worker %s could not take a request for %s (%s: %s); trying another",
                           address, model, type(exc).__name__, exc.message)
            client.worker_failed(address)
            excluded.append(address)
            address = None
            last = exc
    assert last is not None
    raise last
