"""The async wrapper: runs the engine's step loop in the background and gives every request its
own stream.

All engine state is touched from one place at a time: new requests and aborts are applied by the
loop task between steps (on the event loop), and each step runs on a dedicated worker thread, so
the event loop never blocks on torch. Pass the executor the engine was built on
(``torch_utils.torch_thread``) so that its steps run on the thread that loaded the model. If a
step raises, every in-flight request ends with an error chunk and the engine reports itself dead
(the worker's /health then answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from llmplatform.engine.llm_engine import LLMEngine, SequenceUpdate
from llmplatform.errors import EngineDeadError
from llmplatform.llm.sampling import SamplingParams
from llmplatform.llm.torch_utils import torch_thread
from llmplatform.utils.logs import request_context

logger = logging.getLogger("llmplatform.engine")


@dataclass
class _Stream:
    queue: asyncio.Queue[SequenceUpdate | BaseException]
    num_unfinished: int


class AsyncEngine:
    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        """``executor``: a one-thread executor for the steps (the caller keeps owning it); by
        default the engine gets its own."""
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._pending_adds: list[tuple[str, list[int], SamplingParams]] = []
        self._pending_aborts: list[str] = []
        self._pending_calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._owns_executor = executor is None
        self._executor = executor or torch_thread("engine-step")
        self._task: asyncio.Task | None = None
        self.dead_reason: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(EngineDeadError("the engine is shutting down"))
        if self._owns_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + len(self._pending_adds)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[SequenceUpdate]:
        """Yields the request's updates (for all n outputs) until each has finished. Closing the
        iterator early aborts the request and frees its blocks before the next step."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_reason}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.engine.validate(prompt_token_ids, params)  # raises before anything is queued
        stream = _Stream(asyncio.Queue(), params.n)
        self._streams[request_id] = stream
        self._pending_adds.append((request_id, prompt_token_ids, params))
        self._wakeup.set()
        try:
            while stream.num_unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.chunk.finish_reason is not None:
                    stream.num_unfinished -= 1
                yield item
        finally:
            if self._streams.pop(request_id, None) is not None and stream.num_unfinished:
                self._abort_soon(request_id)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._abort_soon(request_id)
        return True

    async def call_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the engine between two steps (e.g. a prefix-cache reset) and returns its
        result: it never races a step, an admission or an abort."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_reason}")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending_calls.append((fn, future))
        self._wakeup.set()
        return await future

    def _abort_soon(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        self._wakeup.set()

    # ---- the loop ----------------------------------------------------------------------------

    def _apply_pending(self) -> None:
        """Applies queued adds and aborts (only ever between steps)."""
        adds, self._pending_adds = self._pending_adds, []
        for request_id, prompt_token_ids, params in adds:
            if request_id not in self._streams:  # the client left before it was added
                continue
            with request_context(request_id):
                try:
                    self.engine.add_request(request_id, prompt_token_ids, params)
                except Exception as exc:  # validated already; anything here is a bad request too
                    self._streams[request_id].queue.put_nowait(exc)
                    continue
                logger.debug("queued: %d prompt tokens, max_tokens=%d, n=%d",
                             len(prompt_token_ids), params.max_tokens, params.n)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            updates = self.engine.abort(request_id)
            if updates:
                with request_context(request_id):
                    logger.debug("aborted: %d unfinished outputs stopped, their blocks freed",
                                 len(updates))
            for update in updates:
                self._deliver(update)
        calls, self._pending_calls = self._pending_calls, []
        for fn, future in calls:
            if future.cancelled():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _deliver(self, update: SequenceUpdate) -> None:
        stream = self._streams.get(update.request_id)
        if stream is not None:
            stream.queue.put_nowait(update)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    if not (self._pending_adds or self._pending_aborts or self._pending_calls):
                        await self._wakeup.wait()
                    continue
                updates = await loop.run_in_executor(self._executor, self.engine.step)
                for update in updates:
                    self._deliver(update)
                # Let request handlers run (new arrivals, disconnects) before the next step.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine step failed; failing all requests and reporting dead")
            self.dead_reason = f"{type(exc).__name__}: {exc}"
            self._fail_all(EngineDeadError(f"the engine failed: {self.dead_reason}"))

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(error)
        calls, self._pending_calls = self._pending_calls, []
        for _, future in calls:
            if not future.done():
                future.set_exception(error)

