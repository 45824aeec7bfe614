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

A request with ``n`` > 1 is ``n`` sequences whose prompt is computed once (engine.scheduler,
"Parallel sampling"); output ``i`` of a seeded request draws from ``seed + i``; every update says
which output it is (``SequenceUpdate.index``); aborting the request stops all ``n``.

The engine's record of each output (:class:`OutputState`) is kept by sequence id: the scheduler's
and the runner's outputs carry ids and typed records (engine.outputs). The runner comes from
``runner_factory`` (default :meth:`ModelRunner.from_config`), the seam tests inject faults through.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import EngineConfig
from llmplatform.engine.isolation import pinned_fault
from llmplatform.engine.model_runner import ModelRunner, RunnerFactory
from llmplatform.engine.parallel.driver import InFlightStep
from llmplatform.engine.outputs import Failure, ModelOutput, SchedulerOutput, SequenceUpdate, StepStats
from llmplatform.engine.pooling import PoolingParams
from llmplatform.engine.prefix_cache import PrefixCacheStats
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence
from llmplatform.engine.speculative.setup import make_proposer
from llmplatform.errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError
from llmplatform.sampling.grammar_sandbox import GrammarSandbox
from llmplatform.sampling.output_processor import OutputProcessor, eos_token_ids_of
from llmplatform.sampling.outputs import FinishReason, GenerateChunk, TokenLogprob, Usage
from llmplatform.sampling.params import SamplingParams, check_prompt_token_ids
from llmplatform.utils.logs import request_context

if TYPE_CHECKING:
    import numpy as np

    from llmplatform.sampling.grammar import CompiledGrammar

logger = logging.getLogger("llmplatform.engine")


@dataclass
class OutputState:
    """The engine's record of one output (one sequence) until it finishes."""

    seq: Sequence  # the scheduler's sequence, which the engine made: to finish it
    # Turns its tokens into chunks (detokenizing, stops); None for a pooling sequence.
    processor: OutputProcessor | None
    pending_prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # When a step first scheduled the sequence (time.monotonic()), sent on its first chunk so the
    # worker can tell queue time from compute time.
    first_scheduled_time: float | None = None
    first_scheduled_time_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def index(self) -> int:
        return self.seq.index


@dataclass
class LaunchedStep:
    """A step between :meth:`LLMEngine.launch` and :meth:`LLMEngine.complete`: what it
    scheduled, its model work (None: nothing to run) and the rejections it already made."""

    scheduled: SchedulerOutput
    in_flight: InFlightStep | None
    updates: list[SequenceUpdate]
    started: float = 0.0  # time.perf_counter() when launch began

    @property
    def ready(self) -> bool:
        return self.in_flight is None or self.in_flight.ready

    def wait(self) -> None:
        """Blocks until the model work is done (any thread; pipeline stages: the last answered)."""
        if self.in_flight is not None:
            self.in_flight.wait()


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None,
                 runner: ModelRunner | None = None, grammars: GrammarSandbox | None = None,
                 *, runner_factory: RunnerFactory = ModelRunner.from_config,
                 virtual_engine: int = 0, proposer: Any = None) -> None:
        """``runner``: an existing model runner to reuse, weights and all (see :meth:`rebuild`);
        otherwise ``runner_factory(config, tokenizer)`` builds one. ``grammars``: the grammar
        process of the constrained sequences, likewise (made on the first constrained request
        otherwise). ``virtual_engine``: which of the runner's KV pools this engine's blocks
        are (pipeline parallelism: ``engine.virtual_engines``). ``proposer``: an existing
        speculative proposer to reuse (see :meth:`rebuild`)."""
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
        self.runner = runner if runner is not None else runner_factory(config, self.tokenizer)
        self.virtual_engine = virtual_engine
        self.grammars = grammars
        self._outputs: dict[int, OutputState] = {}  # by seq id, until the sequence finishes
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
            enable_prefix_caching=config.cache.enable_prefix_caching,
            attention_window=layout.attention_window)
        self.scheduler = Scheduler(sched, self.block_manager,
                                   max_loras=config.lora.max_loras if config.lora.enabled else 0)
        self.stats = StepStats()
        # Speculative decoding (engine.speculative): proposals made before each schedule.
        # A rebuilt engine keeps its predecessor's (a draft model's weights and pool), reset.
        self.proposer = proposer if proposer is not None else make_proposer(config, self.runner,
                                                                            self.tokenizer)
        if config.speculative is not None:
            logger.info("speculative decoding: %s", config.speculative)
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
        self._outputs[seq.seq_id] = OutputState(seq, processor=None)
        self.scheduler.add_request([seq])
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, grammar: CompiledGrammar | None = None,
                    *, cache_salt: str | None = None, lora_id: int | None = None,
                    priority: int = 0) -> list[Sequence]:
        """Queues the request's ``params.n`` outputs (their prompt computed once, see the module
        docstring); returns their sequences, output ``i`` at index ``i``. ``grammar``: the output
        constraint, compiled already (compiling is no step's work); each output walks it with a
        matcher of its own. ``cache_salt``: only sequences with the same salt share prefix-cache
        blocks (engine.prefix_cache). ``lora_id``: the loaded adapter it runs with (engine.lora;
        None: the base model). ``priority``: lower is scheduled first (engine.priority).

        The request has been admitted (:meth:`validate`, a unique id): only the invariants the
        scheduler relies on are asserted here."""
        assert prompt_token_ids, "an admitted prompt is not empty"
        assert len(prompt_token_ids) + params.max_tokens <= self.max_model_len, "admitted: it fits"
        if lora_id is not None and not (self.runner.loras and self.runner.loras.holds(lora_id)):
            # Admitted with an adapter that was unloaded (and released) before it got here.
            raise ModelNotFoundError("the LoRA adapter this request names was unloaded", param="model")
        seqs = []
        stop_token_ids = tuple(self.eos_token_ids) + params.stop_token_ids
        for index in range(params.n):
            # The walk accepts exactly the output's tokens: preemption keeps those (recompute
            # only rebuilds their KV cache), so it survives preemption unchanged.
            matcher = (self._grammar_sandbox(grammar).new_matcher(
                grammar, stop_token_ids=stop_token_ids) if grammar is not None else None)
            # With a seed, output i draws from seed + i: reproducible, and the n outputs differ.
            seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                           params=params, index=index, cache_salt=cache_salt, lora_id=lora_id,
                           priority=priority,
                           seed=None if params.seed is None else params.seed + index,
                           stop_token_ids=stop_token_ids, grammar=matcher)
            self._outputs[seq.seq_id] = OutputState(seq, OutputProcessor(
                request_id, self.tokenizer, params, prompt_token_ids, self.eos_token_ids,
                self.max_model_len, grammar=matcher))
            seqs.append(seq)
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
        """Stops the request's sequences (all ``n``) and frees their blocks now."""
        return [self._finished_update(seq.seq_id, FinishReason.ABORT)
                for seq in self.scheduler.abort_request(request_id)]

    @property
    def virtual_engines(self) -> list[LLMEngine]:
        """The engines the async engine runs a step loop for: this one (``engine.virtual_engines``
        has several)."""
        return [self]

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
        self.runner.reset_kv_cache()
        if self.proposer is not None:
            self.proposer.reset()
        return LLMEngine(self.config, self.tokenizer, runner=self.runner, grammars=self.grammars,
                         proposer=self.proposer)

    # ---- the step loop -----------------------------------------------------------------------

    def step(self) -> list[SequenceUpdate]:
        return self.complete(self.launch())

    def launch(self) -> LaunchedStep:
        """Schedules and starts the model work (with pipeline stages it is still in flight when
        this returns: see :class:`LaunchedStep`); nothing changes this engine until ``complete``."""
        self.runner.raise_if_ranks_failed()  # a dead rank fails the step (rebuild: new ranks)
        started = time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running, self.block_manager)
        scheduled = self.scheduler.schedule()
        updates = self._reject(scheduled)
        if scheduled.is_empty:
            return LaunchedStep(scheduled, None, updates, started)
        self._note_first_scheduled(scheduled)
        return LaunchedStep(scheduled, self.runner.launch(scheduled, self.virtual_engine), updates,
                            started)

    def complete(self, launched: LaunchedStep) -> list[SequenceUpdate]:
        scheduled, updates = launched.scheduled, launched.updates
        if launched.in_flight is None:
            return updates
        model_output = self.runner.finish(launched.in_flight)
        background = scheduled.num_background_tokens
        self.scheduler.background.observe(scheduled.num_batched_tokens - background, background,
                                          scheduled.busy, time.perf_counter() - launched.started)
        updates += self._fail_pinned(scheduled, model_output)
        self.scheduler.update(scheduled, model_output)
        self._record_stats(scheduled)
        return updates + self._process(scheduled, model_output)

    def _reject(self, scheduled: SchedulerOutput) -> list[SequenceUpdate]:
        return [self._finished_update(seq_id, FinishReason.ERROR, error=reason)
                for seq_id, reason in scheduled.rejected]

    def _fail_pinned(self, scheduled: SchedulerOutput, output: ModelOutput) -> list[SequenceUpdate]:
        """Finishes the sequences whose own sampling failed (before ``scheduler.update``, which
        then skips them: they got no token)."""
        return [self._fail(self._outputs[item.seq_id], output.errors[item.seq_id])
                for item in scheduled.scheduled
                if item.seq_id in output.errors and item.seq_id in self._outputs]

    def _finish(self, state: OutputState) -> None:
        self.scheduler.finish(state.seq)
        self._release_proposals(state.seq.seq_id)
        del self._outputs[state.seq.seq_id]

    def _release_proposals(self, seq_id: int) -> None:
        """A finished sequence's speculative state goes at once (a draft model's pool blocks)."""
        if self.proposer is not None:
            self.proposer.release(seq_id)

    def _fail(self, state: OutputState, failure: Failure) -> SequenceUpdate:
        """Finishes the output with an error and frees its blocks. The chunk is built here, not
        by its output processor, which may be what failed."""
        seq = state.seq
        self._finish(state)
        chunk = GenerateChunk(request_id=seq.request_id, text="", token_ids=(),
                              usage=Usage(seq.num_prompt_tokens, len(seq.output_token_ids)),
                              finish_reason=FinishReason.ERROR, error=failure.message,
                              error_code=failure.error_code)
        return SequenceUpdate(seq.request_id, seq.index, chunk)

    def _process(self, scheduled: SchedulerOutput, output: ModelOutput) -> list[SequenceUpdate]:
        updates = []
        for seq_id, records in output.prompt_logprobs.items():
            if seq_id in self._outputs:
                self._outputs[seq_id].pending_prompt_logprobs.extend(records)
        updates += self._finish_pooled(output.pooled)
        for seq_id, token_id, logprob in zip(output.seq_ids, output.token_ids, output.logprobs):
            state = self._outputs.get(seq_id)
            if state is None:  # aborted while the step ran, or failed above
                continue
            token_ids, logprobs = [token_id], [logprob]
            accepted = output.accepted.get(seq_id)  # proposals kept before it (speculative)
            if accepted is not None:
                token_ids[:0], logprobs[:0] = accepted.token_ids, accepted.logprobs
                self.stats.num_spec_drafts += 1
                self.stats.num_spec_draft_tokens += accepted.num_proposed
                self.stats.num_spec_accepted_tokens += len(accepted.token_ids)
            try:
                chunk = self._output_chunk(state, token_ids, logprobs)
            except Exception as exc:  # detokenizing, stop handling: this sequence's alone
                updates.append(self._fail(state, pinned_fault(state, "output processing", exc)))
                continue
            if chunk.finish_reason is not None:
                self._finish(state)
            updates.append(SequenceUpdate(state.request_id, state.index, chunk))
        return updates

    def _finish_pooled(self, pooled: dict[int, np.ndarray]) -> list[SequenceUpdate]:
        """Pooling sequences whose prompt this step finished: finished now (blocks freed), each
        update carrying its vector."""
        updates = []
        for seq_id, vector in pooled.items():
            state = self._outputs.get(seq_id)
            if state is None:  # aborted while the step ran
                continue
            update = self._finished_update(seq_id, FinishReason.STOP)
            chunk = replace(update.chunk, first_scheduled_time=state.first_scheduled_time)
            updates.append(replace(update, chunk=chunk, pooled=vector))
        if pooled:
            self.stats.num_pooled_seqs += len(pooled)
            self.stats.max_pooled_per_step = max(self.stats.max_pooled_per_step, len(pooled))
        return updates

    def _output_chunk(self, state: OutputState, token_ids: list[int],
                      logprobs: list[TokenLogprob | None]) -> GenerateChunk:
        """The chunk of the tokens this step added to the output (several when it verified
        proposals: a stop among them ends it there, the rest are dropped)."""
        assert state.processor is not None, "a pooling sequence never samples"
        records = logprobs if all(r is not None for r in logprobs) else None
        chunk = state.processor.append(token_ids, records)
        if state.pending_prompt_logprobs and state.seq.params.prompt_logprobs is not None:
            chunk = replace(chunk, prompt_logprobs=tuple(state.pending_prompt_logprobs))
            state.pending_prompt_logprobs = []
        if not state.first_scheduled_time_sent:
            chunk = replace(chunk, first_scheduled_time=state.first_scheduled_time)
            state.first_scheduled_time_sent = True
        return chunk

    def _note_first_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.monotonic()
        for item in scheduled.scheduled:
            state = self._outputs[item.seq_id]
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now

    def _record_stats(self, scheduled: SchedulerOutput) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_preemptions += len(scheduled.preempted)
        for seq_id in scheduled.preempted:
            seq = self._outputs[seq_id].seq
            with request_context(seq.request_id):
                logger.debug("preempted output %d at %d tokens (KV cache full); it will be "
                             "recomputed", seq.index, seq.num_tokens)
        # A deferral waits for blocks a scheduled sequence computes, so no step that defers is
        # empty (empty steps return before this).
        stats.num_deferred_for_prefix += len(scheduled.deferred)
        stats.num_computed_prompt_tokens += scheduled.num_prompt_tokens
        for seq_id, num_blocks in scheduled.deferred:
            seq = self._outputs[seq_id].seq
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

    def _finished_update(self, seq_id: int, reason: FinishReason, error: str | None = None
                         ) -> SequenceUpdate:
        """The last update of an output the engine ends (abort, rejection, a pooled vector); the
        scheduler has finished it or is told to now."""
        state = self._outputs.pop(seq_id)
        seq = state.seq
        self.scheduler.finish(seq)  # a no-op when the scheduler finished it itself
        self._release_proposals(seq_id)
        if state.processor is not None:
            chunk = state.processor.finish(reason, error=error)
        else:
            chunk = GenerateChunk(request_id=seq.request_id, text="", token_ids=(),
                                  usage=Usage(seq.num_prompt_tokens, 0), finish_reason=reason,
                                  error=error)
        return SequenceUpdate(seq.request_id, seq.index, chunk)

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
