"""What a worker does when its backend fails for good (it could not rebuild its engine).

A backend that fails as a whole first tries to recover in-process (the paged engine rebuilds
itself; /health answers 503 meanwhile and the worker stays registered). Only when it cannot,
:func:`watch_backend` records the failure (the controller link then leaves, /health says
"dead") and, in service mode, hands over to ``on_failure``, which exits the process non-zero so
that a supervisor (``llmplatform serve``, systemd, Kubernetes) starts a fresh one rather than
leaving a worker that answers 503 forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from llmplatform.llm.base import LLMBackend

logger = logging.getLogger("llmplatform.worker")

FAILURE_EXIT_GRACE_S = 0.5
"""After leaving the controller, how long the in-flight requests' error chunks get to reach their
clients before ``on_failure`` runs."""

FailureHandler = Callable[[str], None]


async def watch_backend(state: Any, llm: LLMBackend, drain: Callable[[], Awaitable[None]],
                        on_failure: FailureHandler | None) -> None:
    """Waits for ``llm`` to fail for good; sets ``state.backend_failure`` to the reason, then
    (with an ``on_failure``) drains and calls it. Cancelled at the worker's shutdown."""
    reason = await llm.wait_failed()
    state.backend_failure = reason
    if on_failure is None:
        logger.error("the backend failed and cannot recover (%s); this worker answers 503 until "
                     "it is restarted", reason)
        return
    logger.error("the backend failed and cannot recover (%s); leaving the controller and "
                 "exiting", reason)
    await drain()
    await asyncio.sleep(FAILURE_EXIT_GRACE_S)
    on_failure(reason)
