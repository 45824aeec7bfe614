"""The synchronous engine: add requests, step, abort. The step loop is schedule -> execute ->
update; everything else lives in the components.

Each step returns, per sequence that changed, a :class:`SequenceUpdate` with the
:class:`GenerateChunk` of what it added (the shared output processor decides stops, so the
engine's own finishing rules are the same as every other backend's).

A fault in one sequence's own work (its sampling row, its output processing) finishes that
sequence with ``FinishReason.ERROR`` and frees its blocks; the step goes on for the others
(:mod:`.isolation`). Anything else a step raises escapes ``step``: the caller rebuilds the engine
(:meth:`LLMEngine.rebuild`).

Pooling requests (:meth:`LLMEngine.add_pooling_request`, :mod:`.pooling`) share the scheduler and
the step with generation; the step that computes a pooling sequence's last prompt token finishes
it and returns its vector in the update (``SequenceUpdate.pooled``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import EngineConfig
from llmplatform.engine.faults import FaultInjector
from llmplatform.engine.isolation import pinned_fault
from llmplatform.engine.model_runner import ModelRunner
from llmplatform.engine.outputs import Failure, ModelOutput, SchedulerOutput
from llmplatform.engine.pooling import PoolingParams, PoolingState
from llmplatform.engine.prefix_cache import PrefixCacheStats
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence
from llmplatform.errors import ContextLengthExceededError, InvalidRequestError
from llmplatform.sampling.grammar_sandbox import GrammarSandbox
from llmplatform.sampling.output_processor import OutputProcessor, eos_token_ids_of
from llmplatform.sampling.outputs import FinishReason, GenerateChunk, Usage
from llmplatform.sampling.params import SamplingParams, check_prompt_token_ids
from llmplatform.sampling.sampler import SamplingRow, make_generator
from llmplatform.utils.logs import request_context

if TYPE_CHECKING:
    from llmplatform.sampling.grammar import CompiledGrammar
    from llmplatform.sampling.grammar_matcher import SequenceGrammar
    from llmplatform.sampling.grammar_sandbox import RemoteGrammar

logger = logging.getLogger("llmplatform.engine")


@dataclass(frozen=True)
class SequenceUpdate:
    request_id: str
    index: int  # which of the request's n outputs
    chunk: GenerateChunk
    # A pooling sequence's vector ([hidden] float32 numpy array), on its final update.
    pooled: Any = None


@dataclass
class SeqState:
    """Per-sequence engine state the scheduler does not need: output processing, randomness."""

    processor: OutputProcessor
    generator: Any
    stop_token_ids: tuple[int, ...]
    pending_prompt_logprobs: list = field(default_factory=list)
    # When a step first scheduled the sequence (time.monotonic()), sent on its first chunk so the
    # worker can tell queue time from compute time.
    first_scheduled_time: float | None = None
    first_scheduled_time_sent: bool = False
    # The sequence's walk through its output grammar (structured outputs), if it has one. It
    # has accepted exactly the sequence's output tokens: preemption keeps those (recompute only
    # rebuilds their KV cache), so the walk survives it unchanged.
    grammar: SequenceGrammar | RemoteGrammar | None = None

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        grammar = self.grammar
        if grammar is not None and grammar.num_accepted != len(seq.output_token_ids):
            grammar.replay(seq.output_token_ids)  # never expected: the walk follows the output
        return SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                           output_token_ids=seq.output_token_ids, generator=self.generator,
                           stop_token_ids=self.stop_token_ids, grammar=grammar)


@dataclass
class StepStats:
    num_steps: int = 0
    num_preemptions: int = 0
    # Sum over steps of (tokens stored / token slots allocated) and how many steps were counted.
    kv_efficiency_sum: float = 0.0
    num_batched_tokens: int = 0
    # Pooling sequences finished (vector made), and the most finished by one step (batching).
    num_pooled_seqs: int = 0
    max_pooled_per_step: int = 0
    # Waiting sequences deferred because another one was computing their prefix's next blocks
    # (each counted once per wait; engine.scheduler, "Prefixes in flight").
    num_deferred_for_prefix: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None,
                 runner: ModelRunner | None = None, grammars: GrammarSandbox | None = None
                 ) -> None:
        """``runner``: an existing model runner to reuse, weights and all (see :meth:`rebuild`).
        ``grammars``: the grammar process of the constrained sequences, likewise (made on the
        first constrained request otherwise)."""
        from transformers import AutoTokenizer, GenerationConfig

        self.config = config
        path = config.model.model_path
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        try:
            generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            generation_config = None
        self.eos_token_ids = eos_token_ids_of(self.tokenizer, generation_config)
        sched = config.scheduler
        self.max_model_len = sched.max_model_len
        if runner is None:
            faults = FaultInjector(config.faults, self.tokenizer) if config.faults else None
            runner = ModelRunner(config.model, config.cache, self.tokenizer, sched.max_model_len,
                                 sched.max_num_batched_tokens, faults, config.parallel)
        self.runner = runner
        self.grammars = grammars
        self.faults = runner.faults  # tests only; None in production
        layout = self.runner.layout
        if layout.num_tokens < sched.max_model_len:
            self.runner.close()  # stops the other tensor-parallel ranks (none otherwise)
            raise ValueError(
                f"the KV cache holds {layout.num_tokens} tokens ({layout.num_blocks} blocks of "
                f"{layout.block_size}), less than one sequence of --max-model-len "
                f"{sched.max_model_len}; give it more memory (--kv-cache-memory / "
                f"--gpu-memory-utilization) or lower --max-model-len")
        self.block_manager = BlockManager(
            layout.num_blocks, layout.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.block_manager)
        self.stats = StepStats()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s on %s); max concurrency at "
            "full context (%d tokens): %.1f sequences; prefix caching %s",
            layout.num_blocks, layout.block_size, layout.num_tokens,
            layout.num_blocks * layout.bytes_per_block / 2**30, self.runner.dtype,
            self.runner.device, sched.max_model_len, layout.num_tokens / sched.max_model_len,
            "on" if config.cache.enable_prefix_caching else "off")
        if layout.tensor_parallel_size > 1:
            logger.info("tensor parallel: %d ranks, %d KV head(s) per rank; each rank holds the %d "
                        "blocks for its heads (%.2f GiB per rank)", layout.tensor_parallel_size,
                        layout.num_kv_heads_per_rank, layout.num_blocks,
                        layout.num_blocks * layout.bytes_per_block / 2**30)

    # ---- requests ----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises for a request that can never be served (before anything is allocated), every
        token id it carries checked against the model's vocabulary (the logits' width). This is
        the engine's admission check, run once by whoever admits the request (the backend's
        ``check_request``, ``offline.LLM``); :meth:`add_request` then trusts it."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab_size = int(self.runner.model.vocab_size)  # the logits' width
        check_prompt_token_ids(prompt_token_ids, vocab_size)
        params.check_vocab(vocab_size)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(prompt_token_ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens")
        if params.n > self.config.scheduler.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds --max-num-seqs {self.config.scheduler.max_num_seqs}",
                param="n")

    def validate_pooling(self, prompt_token_ids: list[int]) -> None:
        """Raises for a pooling request that can never be served: empty, a token id outside the
        vocabulary, or longer than ``max_model_len``."""
        if not prompt_token_ids:
            raise InvalidRequestError("the input is empty", param="input")
        check_prompt_token_ids(prompt_token_ids, int(self.runner.model.vocab_size))
        if len(prompt_token_ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"the input has {len(prompt_token_ids)} tokens, more than this model's maximum "
                f"of {self.max_model_len}", param="input")

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                            pooling: PoolingParams) -> Sequence:
        """Queues a prompt to be run for its pooled final hidden states (:mod:`.pooling`).
        Admitted already (:meth:`validate_pooling`)."""
        assert prompt_token_ids and len(prompt_token_ids) <= self.max_model_len
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                       params=_POOLING_SAMPLING, pooling=pooling)
        seq.state = PoolingState(pooling)
        self.scheduler.add_request([seq])
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, grammar: CompiledGrammar | None = None,
                    *, cache_salt: str | None = None) -> list[Sequence]:
        """``grammar``: the output constraint, compiled already (compiling is no step's work);
        each of the ``n`` sequences walks it with a matcher of its own. ``cache_salt``: only
        sequences with the same salt share prefix-cache blocks (engine.prefix_cache).

        The request has been admitted (:meth:`validate`, a unique id): only the invariants the
        scheduler relies on are asserted here."""
        assert prompt_token_ids, "an admitted prompt is not empty"
        assert len(prompt_token_ids) + params.max_tokens <= self.max_model_len, "admitted: it fits"
        seqs = []
        stop_token_ids = tuple(self.eos_token_ids) + params.stop_token_ids
        for index in range(params.n):
            seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                           params=params, index=index, cache_salt=cache_salt)
            # With a seed, output i draws from seed + i: reproducible, and the n outputs differ.
            seed = None if params.seed is None else params.seed + index
            matcher = (self._grammar_sandbox(grammar).new_matcher(
                grammar, stop_token_ids=stop_token_ids) if grammar is not None else None)
            seq.state = SeqState(
                processor=OutputProcessor(request_id, self.tokenizer, params, prompt_token_ids,
                                          self.eos_token_ids, self.max_model_len,
                                          grammar=matcher),
                generator=make_generator(seed, self.runner.device),
                stop_token_ids=stop_token_ids, grammar=matcher)
            seqs.append(seq)
        if self.faults is not None:
            self.faults.arm(seqs, prompt_token_ids)
        self.scheduler.add_request(seqs)
        return seqs

    def _grammar_sandbox(self, grammar: CompiledGrammar) -> GrammarSandbox:
        """Matchers live in a grammar process, so that no grammar can hold the step for more
        than its per-token budget (sampling.grammar_sandbox)."""
        if self.grammars is None:
            self.grammars = GrammarSandbox(grammar.tokenizer_info_json,
                                           token_budget_s=grammar.token_budget_s)
        return self.grammars

    def abort(self, request_id: str) -> list[SequenceUpdate]:
        """Stops the request's sequences and frees their blocks now."""
        return [SequenceUpdate(seq.request_id, seq.index, _finish_chunk(seq, FinishReason.ABORT))
                for seq in self.scheduler.abort_request(request_id)]

    def has_unfinished(self) -> bool:
        """Sequences to step, or a tensor-parallel rank gone (the next step raises why)."""
        return self.scheduler.has_unfinished() or self.runner.ranks_failed

    def rebuild(self) -> LLMEngine:
        """A fresh engine after a step failed in a way no single request explains: a new KV
        pool, block manager and scheduler (the requests of this one are dropped: fail them).

        The loaded weights are reused: nothing writes them after loading (every forward pass
        runs under inference_mode and only writes activations and the KV pool), so a step that
        raised cannot have left them half-changed. A fault that broke the device itself (a
        CUDA error poisons the whole context) makes the new pool's probe forward pass raise,
        and then only a new process helps. Runs on the step thread, like ``step``."""
        if self.faults is not None:
            self.faults.check_rebuild()
        self.runner.reset_kv_cache()
        return LLMEngine(self.config, self.tokenizer, runner=self.runner, grammars=self.grammars)

    # ---- the step loop -----------------------------------------------------------------------

    def step(self) -> list[SequenceUpdate]:
        self.runner.raise_if_ranks_failed()  # a dead rank fails the step (rebuild: new ranks)
        scheduled = self.scheduler.schedule()
        updates = self._reject(scheduled)
        if scheduled.is_empty:
            return updates
        self._note_first_scheduled(scheduled)
        model_output = self.runner.execute(scheduled)
        updates += self._fail_pinned(scheduled, model_output)
        self.scheduler.update(scheduled, model_output)
        self._record_stats(scheduled)
        return updates + self._process(scheduled, model_output)

    def _reject(self, scheduled: SchedulerOutput) -> list[SequenceUpdate]:
        return [SequenceUpdate(seq.request_id, seq.index,
                               _finish_chunk(seq, FinishReason.ERROR, error=reason))
                for seq, reason in scheduled.rejected]

    def _fail_pinned(self, scheduled: SchedulerOutput, output: ModelOutput) -> list[SequenceUpdate]:
        """Finishes the sequences whose own sampling failed (before ``scheduler.update``, which
        then skips them: they got no token)."""
        return [self._fail(item.seq, output.errors[item.seq.seq_id])
                for item in scheduled.scheduled
                if item.seq.seq_id in output.errors and not item.seq.is_finished]

    def _fail(self, seq: Sequence, failure: Failure) -> SequenceUpdate:
        """Finishes ``seq`` with an error and frees its blocks. The chunk is built here, not by
        its output processor, which may be what failed."""
        self.scheduler.finish(seq)
        chunk = GenerateChunk(request_id=seq.request_id, text="", token_ids=(),
                              usage=Usage(seq.num_prompt_tokens, len(seq.output_token_ids)),
                              finish_reason=FinishReason.ERROR, error=failure.message,
                              error_code=failure.error_code)
        return SequenceUpdate(seq.request_id, seq.index, chunk)

    def _process(self, scheduled: SchedulerOutput, output: ModelOutput) -> list[SequenceUpdate]:
        updates = []
        by_seq = {item.seq.seq_id: item.seq for item in scheduled.scheduled}
        prompt_records = output.prompt_logprobs
        for seq_id, records in prompt_records.items():
            by_seq[seq_id].state.pending_prompt_logprobs.extend(records)
        updates += self._finish_pooled(by_seq, output.pooled)
        for seq_id, token_id, logprob in zip(output.seq_ids, output.token_ids, output.logprobs):
            seq = by_seq[seq_id]
            if seq.is_finished:  # aborted while the step ran, or failed above
                continue
            try:
                chunk = self._output_chunk(seq, token_id, logprob)
            except Exception as exc:  # detokenizing, stop handling: this sequence's alone
                updates.append(self._fail(seq, pinned_fault(seq, "output processing", exc)))
                continue
            if chunk.finish_reason is not None:
                self.scheduler.finish(seq)
            updates.append(SequenceUpdate(seq.request_id, seq.index, chunk))
        return updates

    def _finish_pooled(self, by_seq: dict[int, Sequence], pooled: dict[int, Any]
                       ) -> list[SequenceUpdate]:
        """Pooling sequences whose prompt this step finished: finished now (blocks freed), each
        update carrying its vector."""
        updates = []
        for seq_id, vector in pooled.items():
            seq = by_seq[seq_id]
            if seq.is_finished:  # aborted while the step ran
                continue
            self.scheduler.finish(seq)
            chunk = replace(_finish_chunk(seq, FinishReason.STOP),
                            first_scheduled_time=seq.state.first_scheduled_time)
            updates.append(SequenceUpdate(seq.request_id, seq.index, chunk, pooled=vector))
        if pooled:
            self.stats.num_pooled_seqs += len(pooled)
            self.stats.max_pooled_per_step = max(self.stats.max_pooled_per_step, len(pooled))
        return updates

    def _output_chunk(self, seq: Sequence, token_id: int, logprob: Any) -> GenerateChunk:
        state: SeqState = seq.state
        chunk = state.processor.append([token_id], [logprob] if logprob is not None else None)
        if state.pending_prompt_logprobs and seq.params.prompt_logprobs is not None:
            chunk = replace(chunk, prompt_logprobs=tuple(state.pending_prompt_logprobs))
            state.pending_prompt_logprobs = []
        if not state.first_scheduled_time_sent:
            chunk = replace(chunk, first_scheduled_time=state.first_scheduled_time)
            state.first_scheduled_time_sent = True
        return chunk

    def _note_first_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.monotonic()
        for item in scheduled.scheduled:
            if item.seq.state.first_scheduled_time is None:
                item.seq.state.first_scheduled_time = now

    def _record_stats(self, scheduled: SchedulerOutput) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += len(scheduled.preempted)
        for seq in scheduled.preempted:
            with request_context(seq.request_id):
                logger.debug("preempted output %d at %d tokens (KV cache full); it will be "
                             "recomputed", seq.index, seq.num_tokens)
        # A deferral waits for blocks a scheduled sequence computes, so no step that defers is
        # empty (empty steps return before this).
        stats.num_deferred_for_prefix += len(scheduled.deferred)
        for seq, num_blocks in scheduled.deferred:
            with request_context(seq.request_id):
                logger.debug("output %d waits for %d prompt blocks another request is computing "
                             "now (a shared prefix); it reuses them once cached", seq.index,
                             num_blocks)
        stats.num_batched_tokens += scheduled.num_batched_tokens
        running = self.scheduler.running
        slots = sum(len(s.block_table) for s in running) * self.block_manager.block_size
        stored = sum(s.num_computed_tokens for s in running)
        if slots:
            stats.kv_efficiency_sum += stored / slots

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache lookups (queries) and tokens found (hits); zeros when off."""
        return self.block_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (the next request misses). Not concurrently with
        ``step``. True: done (also when prefix caching is off and there is nothing to forget)."""
        self.block_manager.reset_prefix_cache()
        return True


# What a pooling sequence carries as sampling params: it never samples, so only the fields the
# scheduler reads (no prompt logprobs) matter.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


def _finish_chunk(seq: Sequence, reason: FinishReason, error: str | None = None) -> GenerateChunk:
    """The last chunk of a sequence ended by the engine (abort, rejection, a pooled vector)."""
    if seq.pooling is None:
        return seq.state.processor.finish(reason, error=error)
    return GenerateChunk(request_id=seq.request_id, text="", token_ids=(),
                         usage=Usage(seq.num_prompt_tokens, 0), finish_reason=reason, error=error)
