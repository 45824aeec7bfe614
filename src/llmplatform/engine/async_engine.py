"""The async wrapper: runs the engine's step loop in the background and gives every request its
own stream.

All engine state is touched from one place at a time: new requests and aborts are applied by the
loop task between steps (on the event loop), and each step runs on a dedicated worker thread, so
the event loop never blocks on torch. Pass the executor the engine was built on
(``torch_utils.torch_thread``) so that its steps run on the thread that loaded the model.

A fault pinned on one request fails that request inside the step (:mod:`.isolation`). A step that
raises anyway failed as a whole: every in-flight request ends with an error saying to retry it,
and, given a :class:`RestartConfig`, the engine is rebuilt on the step thread (``LLMEngine.rebuild``:
fresh KV pool, block manager and scheduler) while ``is_healthy`` is False, then serves again.
When it may not be rebuilt (no config, more restarts within a minute than allowed) or the rebuild
fails, the engine is dead for good: ``is_healthy`` stays False and :meth:`AsyncEngine.wait_dead`
returns, so a worker can exit and let its supervisor start a fresh process.

With pipeline parallelism the engine is a set of virtual engines (``engine.virtual_engines``) and
there is one step loop per virtual engine, as in vLLM's async engine: each launches its step,
waits for the pipeline off the step thread (so the step thread launches another virtual engine's
step meanwhile: the stages overlap), then completes it. A new request goes to the least loaded
virtual engine; its adds and aborts are applied by that engine's loop between its steps. Calls
between steps wait until no step is in flight (``step_gate``). A failure in any loop stops them
all and rebuilds the whole set. Without stages there is one loop, the engine itself.

Updates reach the streams through each engine's update sink (``LLMEngine.set_update_sink``),
called by whichever thread built them (the step thread, or the output thread when output
processing overlaps the next step: engine.output_pipeline) and handed to the event loop in the
order they were built.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, TypeVar

from llmplatform.engine.config import RestartConfig
from llmplatform.engine.llm_engine import LaunchedStep, LLMEngine
from llmplatform.engine.outputs import SequenceUpdate
from llmplatform.engine.pooling import PoolingParams
from llmplatform.engine.step_gate import StepGate
from llmplatform.engine.virtual_engines import load
from llmplatform.errors import EngineDeadError, EngineRestartingError
from llmplatform.sampling.params import SamplingParams
from llmplatform.utils.logs import request_context
from llmplatform.utils.torch_utils import torch_thread

if TYPE_CHECKING:
    from llmplatform.sampling.grammar import CompiledGrammar

logger = logging.getLogger("llmplatform.engine")

T = TypeVar("T")
RESTART_WINDOW_S = 60.0


@dataclass
class _Stream:
    queue: asyncio.Queue[SequenceUpdate | BaseException]
    num_unfinished: int
    loop: _VirtualLoop  # the virtual engine that holds the request


# (request id, prompt, sampling params and grammar | pooling params and None, cache salt, LoRA id,
# priority)
_Add = tuple[str, list[int], "SamplingParams | PoolingParams", "CompiledGrammar | None", "str | None",
             "int | None", int]


@dataclass
class _VirtualLoop:
    """One virtual engine's step loop state: what to apply between its steps."""

    engine: LLMEngine
    pending_adds: list[_Add] = field(default_factory=list)
    pending_aborts: list[str] = field(default_factory=list)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def load(self) -> int:
        return load(self.engine) + len(self.pending_adds)


class _RestartBudget:
    """At most ``max_restarts_per_minute`` rebuilds within any ``RESTART_WINDOW_S``."""

    def __init__(self, config: RestartConfig, clock: Callable[[], float]) -> None:
        self._max = config.max_restarts_per_minute
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()

    def allows_another(self) -> bool:
        now = self._clock()
        while self._times and now - self._times[0] > RESTART_WINDOW_S:
            self._times.popleft()
        return len(self._times) < self._max

    def spend(self) -> None:
        self._times.append(self._clock())

    def describe(self) -> str:
        return (f"{len(self._times)} restart(s) within {RESTART_WINDOW_S:.0f} s already, "
                f"{self._max} allowed")


def _launch(engine: LLMEngine) -> tuple[LaunchedStep | None, list[SequenceUpdate]]:
    """On the step thread: launches the step and, when its model work is done already (no
    pipeline stages), completes it in the same hop; else returns it in flight."""
    launched = engine.launch()
    if launched.ready:
        return None, engine.complete(launched)
    return launched, []


class AsyncEngine:
    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None,
                 restart: RestartConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``executor``: a one-thread executor for the steps (the caller keeps owning it); by
        default the engine gets its own. ``restart``: rebuild the engine after a step fails as a
        whole, within this bound; None: such a failure is final."""
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._loops = [_VirtualLoop(e) for e in engine.virtual_engines]
        self._gate = StepGate()
        self._owns_executor = executor is None
        self._executor = executor or torch_thread("engine-step")
        self._task: asyncio.Task | None = None
        self._restarts = _RestartBudget(restart, clock) if restart is not None else None
        self.num_restarts = 0  # successful rebuilds since start
        self.restarting = False
        self.dead_reason: str | None = None
        self._dead = asyncio.Event()

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
        """False while rebuilding after a failure and, for good, once dead."""
        return self.dead_reason is None and not self.restarting

    async def wait_dead(self) -> str:
        """Returns, with the reason, once the engine is dead for good (never, while it serves)."""
        await self._dead.wait()
        assert self.dead_reason is not None
        return self.dead_reason

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + sum(len(v.pending_adds) for v in self._loops)

    def _admit(self, request_id: str, add: _Add, num_outputs: int) -> _Stream:
        """Queues the request on the least loaded virtual engine."""
        self.check_serving()
        assert request_id not in self._streams, f"request id {request_id!r} admitted twice"
        target = min(self._loops, key=lambda v: v.load)
        stream = _Stream(asyncio.Queue(), num_outputs, target)
        self._streams[request_id] = stream
        target.pending_adds.append(add)
        target.wakeup.set()
        return stream

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, grammar: CompiledGrammar | None = None, *,
                       cache_salt: str | None = None, lora_id: int | None = None,
                       priority: int = 0) -> AsyncIterator[SequenceUpdate]:
        """Yields the request's updates (for all n outputs) until each has finished. Closing the
        iterator early (or cancelling its consumer) is how a request is aborted: its blocks are
        freed before the next step.
        ``grammar``: the request's compiled output constraint, ``cache_salt`` its prefix-cache
        salt, ``lora_id`` its adapter, ``priority`` its place in the queues
        (``LLMEngine.add_request``).

        The request has been admitted (``LLMEngine.validate`` passed, its id is not running):
        the caller's admission is the one place that checks it."""
        stream = self._admit(request_id, (request_id, prompt_token_ids, params, grammar,
                                          cache_salt, lora_id, priority), params.n)
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
                self._abort_soon(request_id, stream.loop)

    async def pool(self, request_id: str, prompt_token_ids: list[int],
                   pooling: PoolingParams) -> SequenceUpdate:
        """Runs the prompt for its pooled vector (``LLMEngine.add_pooling_request``) and returns
        the final update, whose ``pooled`` is the vector; an update with an error instead when
        the engine failed the request. Cancelling the call aborts the request and frees its
        blocks before the next step. Admitted already (``LLMEngine.validate_pooling``, a
        unique id), like :meth:`generate`'s requests."""
        stream = self._admit(request_id, (request_id, prompt_token_ids, pooling, None, None, None, 0), 1)
        try:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            stream.num_unfinished = 0  # a sequence's only update is its last
            return item
        finally:
            if self._streams.pop(request_id, None) is not None and stream.num_unfinished:
                self._abort_soon(request_id, stream.loop)

    async def call_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` between two steps (e.g. a prefix-cache reset) and returns its
        result: it never races a step, an admission or an abort. Waits out a rebuild, and then
        runs on the new engine."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_reason}")
        async with self._gate.alone():
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine has failed: {self.dead_reason}")
            result = fn(self.engine)
        for virtual in self._loops:  # an idle loop looks again (e.g. finds a rank gone)
            virtual.wakeup.set()
        return result

    def check_serving(self) -> None:
        """Raises the typed error for a request that cannot start now (restarting, dead)."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead_reason}")
        if self.restarting:
            raise EngineRestartingError("the engine failed and is restarting; retry the request")

    def _abort_soon(self, request_id: str, virtual: _VirtualLoop) -> None:
        virtual.pending_aborts.append(request_id)
        virtual.wakeup.set()

    # ---- the loop ----------------------------------------------------------------------------

    def _apply_pending(self, virtual: _VirtualLoop) -> None:
        """Applies a virtual engine's queued adds and aborts (only ever between its steps)."""
        engine = virtual.engine
        adds, virtual.pending_adds = virtual.pending_adds, []
        for request_id, prompt_token_ids, params, grammar, cache_salt, lora_id, priority in adds:
            if request_id not in self._streams:  # the client left before it was added
                continue
            with request_context(request_id):
                try:
                    if isinstance(params, PoolingParams):
                        engine.add_pooling_request(request_id, prompt_token_ids, params)
                        continue
                    engine.add_request(request_id, prompt_token_ids, params, grammar,
                                            cache_salt=cache_salt, lora_id=lora_id,
                                            priority=priority)
                except Exception as exc:  # admitted already: a bug, but this request's alone
                    logger.exception("adding the request failed")
                    self._streams[request_id].queue.put_nowait(exc)
                    continue
                logger.debug("queued: %d prompt tokens, max_tokens=%d, n=%d",
                             len(prompt_token_ids), params.max_tokens, params.n)
        aborts, virtual.pending_aborts = virtual.pending_aborts, []
        for request_id in aborts:
            num_stopped = sum(not seq.is_finished
                              for seq in engine.scheduler.get_request_seqs(request_id))
            self._deliver_all(engine.abort(request_id))  # none: they go to the sink
            if num_stopped:
                with request_context(request_id):
                    logger.debug("aborted: %d unfinished outputs stopped, their blocks freed",
                                 num_stopped)

    def _deliver_all(self, updates: list[SequenceUpdate]) -> None:
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is not None:
                stream.queue.put_nowait(update)

    def _sink(self, loop: asyncio.AbstractEventLoop, updates: list[SequenceUpdate]) -> None:
        """An engine's update sink (any thread): delivered on the event loop, in order."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            loop.call_soon_threadsafe(self._deliver_all, updates)

    async def _run(self) -> None:
        while True:
            try:
                await self._step_loops()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not await self._recover(exc):
                    return
            except BaseException as exc:  # e.g. SystemExit on the step thread: no rebuild
                self._die(f"{type(exc).__name__}: {exc}")
                raise

    async def _step_loops(self) -> None:
        """Runs every virtual engine's loop until one fails (the others are stopped first)."""
        sink = functools.partial(self._sink, asyncio.get_running_loop())
        for virtual in self._loops:
            virtual.engine.set_update_sink(sink)
        tasks = [asyncio.create_task(self._step_loop(v), name=f"engine-loop-{i}")
                 for i, v in enumerate(self._loops)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        raise next(task.exception() for task in done if task.exception() is not None)

    async def _step_loop(self, virtual: _VirtualLoop) -> None:
        loop = asyncio.get_running_loop()
        engine = virtual.engine
        while True:
            self._apply_pending(virtual)
            if not engine.has_unfinished():
                virtual.wakeup.clear()
                if not (virtual.pending_adds or virtual.pending_aborts):
                    await virtual.wakeup.wait()
                continue
            async with self._gate.step():
                launched, updates = await loop.run_in_executor(self._executor, _launch, engine)
                if launched is not None:  # in the pipeline: the step thread is free meanwhile
                    await asyncio.to_thread(launched.wait)
                    updates = await loop.run_in_executor(self._executor, engine.complete, launched)
            self._deliver_all(updates)  # none: they went to the sink
            # Let request handlers run (new arrivals, disconnects) before the next step.
            await asyncio.sleep(0)

    async def _recover(self, exc: Exception) -> bool:
        """After a step failed as a whole: fail the in-flight requests and rebuild the engine.
        False when the engine is dead for good instead."""
        reason = f"{type(exc).__name__}: {exc}"
        self.restarting = True
        num_failed = len(self._streams)
        self._fail_in_flight(EngineRestartingError(
            f"the engine failed ({reason}) and is restarting; retry the request"))
        if self._restarts is None or not self._restarts.allows_another():
            why = self._restarts.describe() if self._restarts else "restarts are off"
            logger.error("engine step failed (%s); failed %d in-flight request(s); not "
                         "restarting it (%s)", reason, num_failed, why, exc_info=exc)
            return self._die(f"{reason}; not restarted: {why}")
        logger.error("engine step failed (%s); failed %d in-flight request(s); restarting the "
                     "engine", reason, num_failed, exc_info=exc)
        started = time.monotonic()
        self._restarts.spend()
        try:
            async with self._gate.alone():
                self.engine = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.engine.rebuild)
            self._loops = [_VirtualLoop(e) for e in self.engine.virtual_engines]
        except Exception as rebuild_exc:
            logger.error("the engine could not be rebuilt", exc_info=rebuild_exc)
            return self._die(f"{reason}; then the rebuild failed: "
                             f"{type(rebuild_exc).__name__}: {rebuild_exc}")
        self.num_restarts += 1
        self.restarting = False
        logger.warning("engine restarted in %.1f s (restart %d since start); serving again",
                       time.monotonic() - started, self.num_restarts)
        return True

    def _die(self, reason: str) -> bool:
        self.dead_reason = reason
        self.restarting = False
        self._fail_all(EngineDeadError(f"the engine failed: {reason}"))
        self._dead.set()
        return False

    def _fail_in_flight(self, error: BaseException) -> None:
        """Every request the engine holds or is about to take ends with ``error``; calls waiting
        for a step boundary stay queued for the next engine."""
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(error)
        for virtual in self._loops:
            virtual.pending_adds.clear()
            virtual.pending_aborts.clear()

    def _fail_all(self, error: BaseException) -> None:
        """Calls waiting for a step boundary see ``dead_reason`` once they run, and raise."""
        self._fail_in_flight(error)

