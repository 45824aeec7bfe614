"""Cross-request batching for embeddings: many small requests run as a few padded batches.

Every request's inputs join one queue. A single background task takes what is queued, having
waited at most ``max_wait_s`` after the first arrival for more to come (or less, once a batch's
worth of tokens is there), sorts it by length and cuts it into batches whose size stays within
``max_batch_tokens``: the padded size (``num_inputs * longest``) for a runner that pads, the
tokens themselves for one that packs inputs into rows without padding (``packed``). Sorting
first keeps the padding small; one input longer than the bound runs alone. Batches run one at a
time on the model's torch thread (the forward pass uses every core already): while one runs, new
arrivals queue up and form the next, so under load the wait costs nothing and the batches grow
by themselves.

A vector must not depend on its batch: the model masks padding, and only float summation order
differs between batch shapes (well under 1e-5 cosine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmplatform.errors import EngineDeadError, LLMPlatformError
from llmplatform.llm.base import BackendInfo, LoadStats, ModelFacts

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("llmplatform.embeddings")

RunBatch = Callable[[list[Sequence[int]]], np.ndarray]
"""Runs one batch (token id lists, sorted by length) and returns ``[len(batch), dimensions]``
float32: blocking, called in the batcher's thread."""


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_tokens: int = 16384
    """Tokens per forward pass at most: padded (inputs x longest input), or the inputs' own
    tokens when ``packed``."""
    max_wait_s: float = 0.002
    """How long the first queued input waits for company before its batch runs."""
    packed: bool = False
    """The runner packs inputs without padding: a batch is bounded by its tokens, not by
    ``num_inputs * longest``."""

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")


@dataclass
class _Item:
    token_ids: Sequence[int]
    future: asyncio.Future[np.ndarray]


def plan_batches(lengths: Sequence[int], max_batch_tokens: int, *,
                 packed: bool = False) -> list[list[int]]:
    """Indices into ``lengths`` grouped into batches: ascending length, each batch's
    ``count * longest`` (``packed``: the sum of its lengths) within ``max_batch_tokens`` (an
    input over it alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    current_tokens = 0
    for index in order:
        length = max(lengths[index], 1)  # ascending: the newcomer is the longest
        size = current_tokens + length if packed else (len(current) + 1) * length
        if current and size > max_batch_tokens:
            batches.append(current)
            current, current_tokens = [], 0
        current.append(index)
        current_tokens += length
    if current:
        batches.append(current)
    return batches


class EmbedBatcher:
    def __init__(self, run_batch: RunBatch, executor: concurrent.futures.Executor,
                 config: BatchingConfig = BatchingConfig()) -> None:
        """``executor``: the model's one torch thread (``utils.torch_utils.torch_thread``),
        which the batcher does not own."""
        self._run_batch = run_batch
        self._executor = executor
        self._config = config
        self._queue: list[_Item] = []
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.num_waiting = 0
        """Inputs queued, not yet in a running batch."""
        self.num_running = 0
        """Inputs in the batch running now."""
        self.num_batches = 0
        """Batches run since start (with ``num_batched_inputs``: how well requests batch)."""
        self.num_batched_inputs = 0
        """Inputs in those batches."""
        self.max_batch_inputs = 0
        """The most inputs one batch held."""

    async def start(self) -> None:
        """Starts the batching task on the running loop (again after a shutdown)."""
        self._closed = False
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="embed-batcher")

    async def shutdown(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail(self._queue, EngineDeadError("the embedding backend shut down"))
        self._queue = []

    async def embed(self, token_id_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One vector per input, in order, once every batch holding them has run."""
        if self._closed or self._arrived is None:
            raise EngineDeadError("the embedding backend is not running")
        loop = asyncio.get_running_loop()
        items = [_Item(ids, loop.create_future()) for ids in token_id_lists]
        self._queue.extend(items)
        self.num_waiting += len(items)
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(item.future for item in items)))
        except BaseException:
            for item in items:  # a cancelled request's inputs that have not run are dropped
                item.future.cancel()
            raise

    async def _loop(self) -> None:
        assert self._arrived is not None
        while True:
            await self._arrived.wait()
            await self._gather_more()
            self._arrived.clear()
            taken, self._queue = self._queue, []
            self.num_waiting -= len(taken)
            live = [item for item in taken if not item.future.done()]
            lengths = [len(item.token_ids) for item in live]
            for indices in plan_batches(lengths, self._config.max_batch_tokens,
                                        packed=self._config.packed):
                batch = [live[i] for i in indices if not live[i].future.done()]
                if batch:
                    await self._run(batch)

    async def _gather_more(self) -> None:
        """Wait up to ``max_wait_s`` for more inputs, less once a full batch is queued."""
        deadline = asyncio.get_running_loop().time() + self._config.max_wait_s
        while True:
            queued_tokens = sum(len(item.token_ids) for item in self._queue)
            remaining = deadline - asyncio.get_running_loop().time()
            if queued_tokens >= self._config.max_batch_tokens or remaining <= 0:
                return
            assert self._arrived is not None
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    async def _run(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        self.num_running = len(batch)
        self.num_batches += 1
        self.num_batched_inputs += len(batch)
        self.max_batch_inputs = max(self.max_batch_inputs, len(batch))
        try:
            vectors = await loop.run_in_executor(self._executor, self._run_batch,
                                                 [item.token_ids for item in batch])
        except Exception as exc:  # a failed forward pass fails its batch, not the batcher
            logger.exception("an embedding batch of %d inputs failed", len(batch))
            self._fail(batch, LLMPlatformError(f"the embedding forward pass failed: "
                                               f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self.num_running = 0
        for item, vector in zip(batch, vectors):
            if not item.future.done():
                item.future.set_result(vector)

    @staticmethod
    def _fail(items: Sequence[_Item], exc: BaseException) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(exc)


class BatchedBackendMixin:
    """The part of an ``LLMBackend`` whose forward passes go through an :class:`EmbedBatcher` on
    one torch thread (the encoder embedding and cross-encoder backends): its facts, start and
    shutdown, load and backend info. The class sets ``_facts``, ``_batcher``, ``_executor``,
    ``device``, ``dtype`` and ``backend_name``."""

    _facts: ModelFacts
    _batcher: EmbedBatcher
    _executor: concurrent.futures.ThreadPoolExecutor
    device: torch.device
    dtype: torch.dtype
    backend_name: str

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    async def start(self) -> None:
        await self._batcher.start()

    async def shutdown(self) -> None:
        await self._batcher.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def load(self) -> LoadStats:
        return LoadStats(num_running=self._batcher.num_running, num_waiting=self._batcher.num_waiting)

    def backend_info(self) -> BackendInfo:
        return BackendInfo(backend=self.backend_name, dtype=str(self.dtype).removeprefix("torch."),
                           device=str(self.device))
