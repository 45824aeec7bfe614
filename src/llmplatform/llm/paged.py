"""The native backend: our paged-attention engine behind the unified LLM interface.

A step that fails as a whole makes the engine rebuild itself in-process (fresh KV cache, the
in-flight requests failed with an error saying to retry; :mod:`llmplatform.engine.async_engine`),
within ``EngineConfig.restart``'s bound; :meth:`PagedLLM.wait_failed` returns when it cannot. The
test-only fault injection (:mod:`llmplatform.engine.faults`) is read from the environment here,
once, when no config gives one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import AsyncIterator, Sequence

from llmplatform.engine.async_engine import AsyncEngine
from llmplatform.engine.config import EngineConfig
from llmplatform.engine.faults import faults_from_env
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.errors import EngineDeadError, InvalidRequestError
from llmplatform.kernels import attention_backend
from llmplatform.llm.base import BackendInfo, GenerateRequest, LLMBackend, LoadStats, ModelFacts
from llmplatform.sampling.outputs import GenerateChunk
from llmplatform.sampling.params import SamplingParams
from llmplatform.utils.torch_utils import torch_thread

logger = logging.getLogger("llmplatform.paged")


class PagedLLM(LLMBackend):
    """Continuous batching on a paged KV cache (llmplatform.engine)."""

    default_concurrency = 1024  # the engine queues and batches requests itself
    backend_name = "paged"

    def __init__(self, config: EngineConfig) -> None:
        if config.faults is None and (faults := faults_from_env()) is not None:
            config = dataclasses.replace(config, faults=faults)
        # The engine is built (weights, KV cache, warm-up) on the thread that will run its steps.
        self._thread = torch_thread("engine-step")
        self._async: AsyncEngine | None = None  # from start(); owns the engine from then on
        try:
            self._engine = self._thread.submit(LLMEngine, config).result()
        except BaseException:
            self._thread.shutdown(wait=True)
            raise
        self.tokenizer = self.engine.tokenizer
        self._facts = ModelFacts(names=config.model.model_names,
                                 context_length=config.scheduler.max_model_len,
                                 vocab_size=int(self.engine.runner.model.lm_head_weight.shape[0]),
                                 eos_token_ids=self.engine.eos_token_ids)
        self._closed = False

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def engine(self) -> LLMEngine:
        """The current engine (a new one after each rebuild)."""
        return self._async.engine if self._async is not None else self._engine

    @property
    def max_num_running(self) -> int:
        return self.engine.config.scheduler.max_num_seqs

    async def start(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._async is None:
            self._async = AsyncEngine(self._engine, self._thread, restart=self._engine.config.restart)
            self._async.start()

    async def shutdown(self) -> None:
        self._closed = True
        if self._async is not None:
            await self._async.shutdown()
            self._async = None
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._thread.shutdown, wait=True, cancel_futures=True))

    def is_healthy(self) -> bool:
        return self._async is None or self._async.is_healthy

    async def wait_failed(self) -> str:
        if self._async is None:
            await self.start()
        assert self._async is not None
        return await self._async.wait_dead()

    def load(self) -> LoadStats:
        cache = self.engine.prefix_cache_stats
        if self._async is None:
            num_running = num_waiting = 0
        else:
            num_running, num_waiting = self._async.num_running, self._async.num_waiting
        return LoadStats(num_running=num_running, num_waiting=num_waiting,
                         kv_cache_usage=self.engine.kv_cache_usage,
                         prefix_cache_queries=cache.num_queried_tokens,
                         prefix_cache_hits=cache.num_hit_tokens,
                         num_free_kv_blocks=self.engine.block_manager.num_free_blocks,
                         num_kv_blocks=self.engine.block_manager.num_blocks,
                         num_preemptions=self.engine.stats.num_preemptions,
                         num_engine_restarts=self._async.num_restarts if self._async else 0)

    def backend_info(self) -> BackendInfo:
        layout = self.engine.runner.layout
        runner = self.engine.runner
        dtype = _dtype_name(runner.dtype)
        if runner.compute_dtype != runner.dtype:
            dtype += f" ({_dtype_name(runner.compute_dtype)} matmuls)"
        return BackendInfo(backend=self.backend_name, dtype=dtype,
                           device=str(self.engine.runner.device), num_kv_blocks=layout.num_blocks,
                           kv_block_size=layout.block_size,
                           attention=attention_backend(self.engine.runner.device).value)

    async def abort(self, request_id: str) -> bool:
        return self._async is not None and await self._async.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        if self._async is None:
            return self.engine.reset_prefix_cache()
        # Between two steps, like admissions and aborts: never during a step's lookups.
        return await self._async.call_between_steps(lambda engine: engine.reset_prefix_cache())

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        _one_output(params)
        self.engine.validate(list(prompt_token_ids), params)  # what add_request checks first

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self._async is None:
            await self.start()
        assert self._async is not None
        _one_output(request.params)
        self._async.check_serving()
        prompt_ids = (list(request.prompt_token_ids) if request.prompt_token_ids is not None
                      else await self.encode(request.prompt or ""))
        updates = self._async.generate(request.request_id, prompt_ids, request.params,
                                       request.grammar)
        try:
            async for update in updates:
                yield update.chunk
        finally:
            await updates.aclose()


def _one_output(params: SamplingParams) -> None:
    if params.n != 1:
        raise InvalidRequestError("one output per request through this interface (n=1)", param="n")


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
