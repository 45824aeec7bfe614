"""Steps of several step loops at once, and calls that must see no step at all.

With pipeline parallelism the async engine runs one step loop per virtual engine, so several
steps are in flight together. A call between steps (a prefix-cache reset, a rebuild after a
failure) must not race any of them: it waits until every step in flight has completed, and no new
step starts while it waits or runs (calls go first, so a busy engine cannot starve them).
With one loop this is exactly "between two steps".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class StepGate:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._num_steps = 0  # steps in flight
        self._num_calls = 0  # calls waiting or running
        self._one_call = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def step(self) -> AsyncIterator[None]:
        """Around one step (launch to complete); waits while a call waits or runs."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._num_calls == 0)
            self._num_steps += 1
        try:
            yield
        finally:
            async with self._changed:
                self._num_steps -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """Around a call that must see no step in flight, nor another call (a rebuild awaits
        the step thread: a call arriving meanwhile waits for it, then sees the new engine)."""
        async with self._changed:
            self._num_calls += 1
            try:
                await self._changed.wait_for(lambda: self._num_steps == 0)
            except BaseException:
                self._num_calls -= 1
                self._changed.notify_all()
                raise
        try:
            async with self._one_call:
                yield
        finally:
            async with self._changed:
                self._num_calls -= 1
                self._changed.notify_all()
