"""Virtual engines: with P pipeline stages, P engines over one model runner, so that P steps are
in the pipeline at once.

A pipeline of P stages computes one micro-batch at a time per stage; a single engine, whose next
step needs the tokens its last step samples, would leave all stages but one idle. So (as vLLM's
virtual engines) there are P :class:`LLMEngine` s, each with its own scheduler, block manager and
share of the KV cache (its own pool on every stage: ``ModelRunner.kv_pools``), sharing the model
runner, tokenizer and weights. A request goes to the least loaded one (running + waiting
sequences) and stays there: preemption, abort, prefix caching and chunked prefill work per
virtual engine exactly as in one engine. Each has at most one step in flight; while stage 2
computes virtual engine A's micro-batch, stage 1 computes B's.

The async engine runs one step loop per virtual engine (``AsyncEngine``, over
``virtual_engines``); :meth:`VirtualEngines.step` is the synchronous equivalent (offline use,
tests): launch every virtual engine's step, then complete each. Everything else the serving layer
asks of an engine (admission checks, stats, the KV cache's fill) is answered here for all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llmplatform.engine.config import EngineConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.model_runner import ModelRunner, RunnerFactory
from llmplatform.engine.outputs import SequenceUpdate, StepStats
from llmplatform.engine.prefix_cache import PrefixCacheStats


def load(engine: LLMEngine) -> int:
    """What picking the least loaded virtual engine compares: its running and waiting sequences."""
    return engine.scheduler.num_running + engine.scheduler.num_waiting


class VirtualEngines:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None,
                 runner: ModelRunner | None = None,
                 *, runner_factory: RunnerFactory = ModelRunner.from_config) -> None:
        first = LLMEngine(config, tokenizer, runner, runner_factory=runner_factory)
        self.virtual_engines: list[LLMEngine] = [first] + [
            LLMEngine(config, first.tokenizer, first.runner, virtual_engine=index)
            for index in range(1, config.parallel.pipeline_parallel_size)]
        self.config = config
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.runner = first.runner
        self.max_model_len = first.max_model_len
        self.validate = first.validate  # the same model and limits for all
        self.validate_pooling = first.validate_pooling
        self.block_manager = _Pools(self.virtual_engines)
        self.scheduler = _Schedulers(self.virtual_engines)

    def least_loaded(self) -> LLMEngine:
        return min(self.virtual_engines, key=load)

    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        return self.least_loaded().add_request(*args, **kwargs)

    def add_pooling_request(self, *args: Any, **kwargs: Any) -> Any:
        return self.least_loaded().add_pooling_request(*args, **kwargs)

    def abort(self, request_id: str) -> list[SequenceUpdate]:
        return [update for engine in self.virtual_engines for update in engine.abort(request_id)]

    def has_unfinished(self) -> bool:
        return any(engine.has_unfinished() for engine in self.virtual_engines)

    def step(self) -> list[SequenceUpdate]:
        """One step of every virtual engine, all launched before any is completed (so they
        overlap in the stages)."""
        launched = [(engine, engine.launch()) for engine in self.virtual_engines]
        return [update for engine, step in launched for update in engine.complete(step)]

    def rebuild(self) -> VirtualEngines:
        """Fresh virtual engines over the same weights (``LLMEngine.rebuild``): new KV pools,
        block managers and schedulers, the other ranks started again."""
        for engine in self.virtual_engines:
            engine.close_outputs()
        self.runner.reset_kv_cache()
        fresh = VirtualEngines(self.config, self.tokenizer, runner=self.runner)
        for new, old in zip(fresh.virtual_engines, self.virtual_engines, strict=True):
            new.grammars = old.grammars  # each one's grammar process (made on its first grammar)
        return fresh

    @property
    def stats(self) -> StepStats:
        total = StepStats()
        for engine in self.virtual_engines:
            for field in dataclasses.fields(StepStats):
                value = getattr(engine.stats, field.name)
                combine = max if field.name.startswith("max_") else (lambda a, b: a + b)
                setattr(total, field.name, combine(getattr(total, field.name), value))
        return total

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        total = PrefixCacheStats()
        for engine in self.virtual_engines:
            for field in dataclasses.fields(PrefixCacheStats):
                setattr(total, field.name, getattr(total, field.name)
                        + getattr(engine.prefix_cache_stats, field.name))
        return total

    def reset_prefix_cache(self) -> bool:
        return all([engine.reset_prefix_cache() for engine in self.virtual_engines])


class _Pools:
    """The virtual engines' block managers read as one pool (for load reports)."""

    def __init__(self, engines: list[LLMEngine]) -> None:
        self._managers = [engine.block_manager for engine in engines]

    @property
    def num_blocks(self) -> int:
        return sum(manager.num_blocks for manager in self._managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(manager.num_free_blocks for manager in self._managers)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._managers[0].enable_prefix_caching


class _Schedulers:
    """The virtual engines' schedulers read as one (for load reports)."""

    def __init__(self, engines: list[LLMEngine]) -> None:
        self._schedulers = [engine.scheduler for engine in engines]

    @property
    def num_running(self) -> int:
        return sum(scheduler.num_running for scheduler in self._schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(scheduler.num_waiting for scheduler in self._schedulers)

    def lora_ids_in_use(self) -> set[int]:
        return set().union(*(scheduler.lora_ids_in_use() for scheduler in self._schedulers))


def build_engine(config: EngineConfig, tokenizer: Any | None = None, *,
                 runner_factory: RunnerFactory = ModelRunner.from_config) -> LLMEngine | VirtualEngines:
    """The engine ``config`` asks for: one, or with pipeline stages one per stage."""
    if config.parallel.pipeline_parallel_size > 1:
        return VirtualEngines(config, tokenizer, runner_factory=runner_factory)
    return LLMEngine(config, tokenizer, runner_factory=runner_factory)
