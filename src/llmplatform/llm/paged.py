"""The native backend: our paged-attention engine behind the unified LLM interface.

A step that fails as a whole makes the engine rebuild itself in-process (fresh KV cache, the
in-flight requests failed with an error saying to retry; :mod:`llmplatform.engine.async_engine`),
within ``EngineConfig.restart``'s bound; :meth:`PagedLLM.wait_failed` returns when it cannot.
``runner_factory`` is the engine's model-runner seam (``engine.model_runner.RunnerFactory``); the
fault tests pass one that injects faults.

Given a :class:`~llmplatform.llm.decoder_embedding.DecoderEmbedding`, it serves embeddings instead
of generation (``--task embed``): each input is one pooling request of the engine
(:mod:`llmplatform.engine.pooling`), so concurrent requests' inputs are batched by the engine's
scheduler like any prompts, and a generation request is refused with a 400.

With tensor parallelism the engine's other ranks are processes (``engine.parallel``): one that
dies while the engine idles wakes the engine loop, whose next look fails like a step and rebuilds
the engine with fresh ranks (or, past the restart budget, leaves it dead with the reason);
``shutdown`` stops them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from llmplatform.engine.async_engine import AsyncEngine
from llmplatform.engine.config import EngineConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.virtual_engines import VirtualEngines, build_engine
from llmplatform.engine.lora import LoRAManager
from llmplatform.engine.model_runner import ModelRunner, RunnerFactory
from llmplatform.errors import EngineDeadError, InvalidRequestError, LLMPlatformError, ModelNotFoundError
from llmplatform.llm.base import (AdmittedRequest, BackendInfo, GenerateRequest, LLMBackend,
                                  LoadStats, LoRAInfo, ModelFacts)
from llmplatform.llm.decoder_embedding import DecoderEmbedding
from llmplatform.llm.embedding import EmbeddingFacts, EmbeddingResult, ModelTask
from llmplatform.models.quantized import quantization_summary
from llmplatform.sampling.outputs import GenerateChunk
from llmplatform.utils.torch_utils import torch_thread

logger = logging.getLogger("llmplatform.paged")


class PagedLLM(LLMBackend):
    """Continuous batching on a paged KV cache (llmplatform.engine)."""

    default_concurrency = 1024  # the engine queues and batches requests itself
    backend_name = "paged"
    parallel_sampling = True  # n outputs fork one prompt's blocks (engine.llm_engine)
    priority_scheduling = True  # the scheduler's queues are in priority order (engine.priority)

    def __init__(self, config: EngineConfig, embedding: DecoderEmbedding | None = None, *,
                 runner_factory: RunnerFactory = ModelRunner.from_config) -> None:
        """``embedding``: serve embeddings with this pipeline instead of generation.
        ``runner_factory``: builds the engine's model runner (the default one unless a test
        injects faults)."""
        # The engine is built (weights, KV cache, warm-up) on the thread that will run its steps.
        self._thread = torch_thread("engine-step")
        self._async: AsyncEngine | None = None  # from start(); owns the engine from then on
        try:
            self._engine = self._thread.submit(build_engine, config,
                                               runner_factory=runner_factory).result()
        except BaseException:
            self._thread.shutdown(wait=True)
            raise
        self.tokenizer = self.engine.tokenizer
        self.embedding = embedding
        self._backend_info: BackendInfo | None = None  # fixed for this worker's life: see backend_info
        self._facts = ModelFacts(names=config.model.model_names,
                                 context_length=config.scheduler.max_model_len,
                                 vocab_size=int(self.engine.runner.model.vocab_size),
                                 eos_token_ids=self.engine.eos_token_ids)
        if embedding is not None:
            self._facts = dataclasses.replace(self._facts, tasks=(ModelTask.EMBED,),
                                              embedding=self._embedding_facts(embedding))
            logger.info("serving embeddings: %s pooling of the final hidden states%s, %d "
                        "dimensions, inputs up to %d tokens", embedding.pooling.mode,
                        " (L2-normalized)" if embedding.pooling.normalize else "",
                        self._facts.embedding.dimensions, self._facts.embedding.max_input_tokens)
        self._closed = False

    def _embedding_facts(self, embedding: DecoderEmbedding) -> EmbeddingFacts:
        limit = self._facts.context_length
        if embedding.max_seq_length is not None:
            limit = min(limit, embedding.max_seq_length)
        hidden_size = int(self.engine.runner.model.lm_head_weight.shape[1])
        return EmbeddingFacts(dimensions=hidden_size, max_input_tokens=limit,
                              normalized=embedding.pooling.normalize,
                              matryoshka_dimensions=embedding.matryoshka_dimensions)

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def engine(self) -> LLMEngine | VirtualEngines:
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
            ranks = self._engine.runner.tp
            if ranks is not None:
                loop = asyncio.get_running_loop()
                ranks.on_failure = lambda: loop.call_soon_threadsafe(self._wake_for_rank_failure)

    def _wake_for_rank_failure(self) -> None:
        """A rank died: an idle engine loop wakes up (a no-op between steps) to find it."""
        if self._async is None or self._async.dead_reason is not None:
            return
        waking = asyncio.ensure_future(self._async.call_between_steps(lambda engine: None))
        waking.add_done_callback(lambda future: future.cancelled() or future.exception())

    async def shutdown(self) -> None:
        self._closed = True
        if self._async is not None:
            await self._async.shutdown()
            self._async = None
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._thread.shutdown, wait=True, cancel_futures=True))
        await asyncio.to_thread(self.engine.runner.close)  # the other tensor-parallel ranks

    def is_healthy(self) -> bool:
        return self._async is None or self._async.is_healthy

    async def wait_failed(self) -> str:
        if self._async is None:
            await self.start()
        assert self._async is not None
        return await self._async.wait_dead()

    def load(self) -> LoadStats:
        cache = self.engine.prefix_cache_stats
        caching = self.engine.block_manager.enable_prefix_caching  # None below: "no prefix cache"
        if self._async is None:
            num_running = num_waiting = 0
        else:
            num_running, num_waiting = self._async.num_running, self._async.num_waiting
        return LoadStats(num_running=num_running, num_waiting=num_waiting,
                         kv_cache_usage=self.engine.kv_cache_usage,
                         prefix_cache_queries=cache.num_queried_tokens if caching else None,
                         prefix_cache_hits=cache.num_hit_tokens if caching else None,
                         num_free_kv_blocks=self.engine.block_manager.num_free_blocks,
                         num_kv_blocks=self.engine.block_manager.num_blocks,
                         num_preemptions=self.engine.stats.num_preemptions,
                         num_engine_restarts=self._async.num_restarts if self._async else 0,
                         num_deferred_for_prefix=self.engine.stats.num_deferred_for_prefix,
                         **self._speculative_load())

    def _speculative_load(self) -> dict[str, int]:
        """Speculative decoding's counters (none when it is off: not reported)."""
        if self.engine.config.speculative is None:
            return {}
        stats = self.engine.stats
        return {"spec_num_drafts": stats.num_spec_drafts,
                "spec_num_draft_tokens": stats.num_spec_draft_tokens,
                "spec_num_accepted_tokens": stats.num_spec_accepted_tokens}

    def backend_info(self) -> BackendInfo:
        """What the engine runs on: worked out once, since every status and heartbeat reports it
        and none of it changes (a rebuilt engine has the same configuration)."""
        if self._backend_info is None:
            self._backend_info = self._describe_backend()
        return self._backend_info

    def _describe_backend(self) -> BackendInfo:
        layout = self.engine.runner.layout
        runner = self.engine.runner
        dtype = _dtype_name(runner.dtype)
        if runner.compute_dtype != runner.dtype:
            dtype += f" ({_dtype_name(runner.compute_dtype)} matmuls)"
        return BackendInfo(backend=self.backend_name, dtype=dtype,
                           device=str(self.engine.runner.device), num_kv_blocks=layout.num_blocks,
                           kv_block_size=layout.block_size,
                           attention=self.engine.runner.ops.attention.value,
                           tensor_parallel_size=layout.tensor_parallel_size,
                           num_kv_heads_per_rank=layout.num_kv_heads_per_rank,
                           weights=quantization_summary(runner.model))

    async def reset_prefix_cache(self) -> bool:
        if self._async is None:
            return self.engine.reset_prefix_cache()
        # Between two steps, like admissions and aborts: never during a step's lookups.
        return await self._async.call_between_steps(lambda engine: engine.reset_prefix_cache())

    def check_request(self, request: GenerateRequest) -> AdmittedRequest:
        self._check_generates()
        # The engine's own limits: the vocabulary, the context, n within --max-num-seqs.
        self.engine.validate(list(request.prompt_token_ids), request.params)
        lora_id = None
        if request.lora_name is not None:
            adapter = self._loras.get(request.lora_name) if self._loras is not None else None
            if adapter is None:
                raise ModelNotFoundError(f"no LoRA adapter named {request.lora_name!r} is loaded",
                                         param="model")
            lora_id = adapter.lora_id
        return AdmittedRequest.of(request, lora=lora_id)

    # ---- LoRA adapters (engine.lora; the registry lives in the runner, across rebuilds) --------

    @property
    def _loras(self) -> LoRAManager | None:
        return self.engine.runner.loras

    def lora_adapters(self) -> list[LoRAInfo]:
        if self._loras is None:
            return []
        return [LoRAInfo(a.name, self.model_names[0], a.path) for a in self._loras.adapters]

    def load_lora_modules(self, modules: Sequence[tuple[str, str]]) -> None:
        assert self._async is None, "at build, before the step loop runs"
        if modules and (self._loras is None or self.embedding is not None):
            return super().load_lora_modules(modules)
        for name, path in modules:
            try:
                adapter = self._loras.add(name, self._loras.read(path))
            except InvalidRequestError as exc:
                raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from exc
            logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)

    async def load_lora_adapter(self, name: str, path: str) -> LoRAInfo:
        if self._loras is None or self.embedding is not None:
            return await super().load_lora_adapter(name, path)
        if name in self.model_names:
            raise InvalidRequestError(f"{name!r} is the base model's name", param="lora_name")
        loras = self._loras
        # Reading and checking (file IO, tensor copies) off the event loop and off the step
        # thread; registering between two steps, like admissions.
        weights = await asyncio.to_thread(loras.read, path)
        adapter = await self._between_steps(lambda engine: loras.add(name, weights))
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)
        return LoRAInfo(adapter.name, self.model_names[0], adapter.path)

    async def unload_lora_adapter(self, name: str) -> LoRAInfo:
        if self._loras is None:
            return await super().unload_lora_adapter(name)
        loras = self._loras
        adapter = await self._between_steps(
            lambda engine: loras.remove(name, engine.scheduler.lora_ids_in_use()))
        logger.info("LoRA adapter %r unloaded", name)
        return LoRAInfo(adapter.name, self.model_names[0], adapter.path)

    async def _between_steps(self, call: Callable[[LLMEngine], Any]) -> Any:
        if self._async is None:
            return call(self.engine)
        return await self._async.call_between_steps(call)

    async def generate(self, request: AdmittedRequest) -> AsyncIterator[GenerateChunk]:
        if self._async is None:
            await self.start()
        assert self._async is not None
        self._async.check_serving()  # the engine's state now, not the request's
        updates = self._async.generate(request.request_id, list(request.prompt_token_ids),
                                       request.params, request.grammar,
                                       cache_salt=request.cache_salt, lora_id=request.lora,
                                       priority=request.priority)
        try:
            async for update in updates:
                # The engine's chunks name their request; which output is the update's.
                yield update.chunk if not update.index else dataclasses.replace(update.chunk,
                                                                                 index=update.index)
        finally:
            await updates.aclose()

    # ---- embeddings (--task embed) -------------------------------------------------------------

    def _check_generates(self) -> None:
        if self.embedding is not None:
            raise InvalidRequestError(
                f"model {self.model_names[0]!r} is an embedding model: it serves /v1/embeddings, "
                "not chat or completions", param="model")

    def apply_chat_template_sync(self, messages: Sequence[dict[str, Any]],
                                 add_generation_prompt: bool = True, **kwargs: Any) -> str:
        self._check_generates()
        return super().apply_chat_template_sync(messages, add_generation_prompt, **kwargs)

    async def embed(self, token_id_lists: Sequence[Sequence[int]], *,
                    request_id: str | None = None) -> list[EmbeddingResult]:
        """Each input is one pooling request of the engine; they all join its queue at once, so
        the scheduler runs them (and other requests' inputs) together, chunked within its token
        budget. Cancelling the call aborts every input still queued or running."""
        if self.embedding is None:
            return await super().embed(token_id_lists, request_id=request_id)
        if self._async is None:
            await self.start()
        assert self._async is not None
        self._async.check_serving()
        for ids in token_id_lists:  # the engine's limits (empty, vocabulary, length), once
            self.engine.validate_pooling(list(ids))
        # Unique in the engine whatever the client named its request (its id stays in the name).
        prefix = f"{request_id or 'embed'}-{uuid.uuid4().hex}"
        updates = await asyncio.gather(*(
            self._async.pool(f"{prefix}-{index}", list(ids), self.embedding.pooling)
            for index, ids in enumerate(token_id_lists)))
        results = []
        for update in updates:
            if update.pooled is None:
                raise LLMPlatformError(update.chunk.error or "the engine did not embed the input")
            results.append(EmbeddingResult(update.pooled, update.chunk.usage.prompt_tokens))
        return results

    def embedding_token_ids_sync(self, texts: Sequence[str], max_tokens: int | None) -> list[list[int]]:
        if self.embedding is not None and self.embedding.do_lower_case:
            texts = [text.lower() for text in texts]
        return super().embedding_token_ids_sync(texts, max_tokens)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
