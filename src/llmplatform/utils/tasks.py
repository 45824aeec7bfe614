"""A coroutine run as a background task for the length of a block (a service's lifespan)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any


@contextlib.asynccontextmanager
async def in_background(work: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """`work` runs as a task while the block runs; it is cancelled and awaited on the way out."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
