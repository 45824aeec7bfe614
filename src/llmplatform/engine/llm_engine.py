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

Output processing is split (:mod:`.output_pipeline`): the step thread decides from token ids
whether an output ended (and frees its blocks); its chunk (detokenizing, stop strings) is built by
an output job, inline or, with ``async_output_processing``, on an output thread while the next step
runs. With the overlap, ``complete``/``abort`` return the updates built so far (later ones come
with later calls, or go to the sink the async engine sets: :meth:`LLMEngine.set_update_sink`), and
``has_unfinished`` stays True until the last is out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from llmplatform.engine.admission import check_generate, check_pooling, record_step
from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import EngineConfig
from llmplatform.engine.isolation import pinned_fault
from llmplatform.engine.model_runner import ModelRunner, RunnerFactory
from llmplatform.engine.parallel.driver import InFlightStep
from llmplatform.engine.output_pipeline import (JobResult, OutputPipeline, OutputState, Sink, TokenBatch,
                                                emit_batch, error_update, final_update,
                                                resolve_async_output, run_parts)
from llmplatform.engine.outputs import Failure, ModelOutput, SchedulerOutput, SequenceUpdate, StepStats
from llmplatform.engine.pooling import PoolingParams
from llmplatform.engine.prefix_cache import PrefixCacheStats
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence
from llmplatform.engine.speculative.setup import make_proposer
from llmplatform.errors import ModelNotFoundError
from llmplatform.sampling.grammar_sandbox import GrammarSandbox
from llmplatform.sampling.output_processor import OutputProcessor, TokenStops, eos_token_ids_of
from llmplatform.sampling.outputs import FinishReason
from llmplatform.sampling.params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from llmplatform.sampling.grammar import CompiledGrammar

logger = logging.getLogger("llmplatform.engine")


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
        threaded = resolve_async_output(config.async_output_processing, self.runner.device.type)
        self._output = OutputPipeline(threaded, name=f"engine-output-{virtual_engine}")
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
        if virtual_engine == 0:
            logger.info("output processing (--async-output-processing %s): %s",
                        config.async_output_processing,
                        "overlapped with the next step, on an output thread" if threaded
                        else "on the step thread, after each step")
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
        """Raises for a request that can never be served (:func:`.admission.check_generate`),
        before anything is allocated: the engine's admission check, run once by whoever admits
        the request (the backend's ``check_request``, ``offline.LLM``); :meth:`add_request` then
        trusts it."""
        check_generate(prompt_token_ids, params, vocab_size=int(self.runner.model.vocab_size),
                       max_model_len=self.max_model_len,
                       max_num_seqs=self.config.scheduler.max_num_seqs)

    def validate_pooling(self, prompt_token_ids: list[int]) -> None:
        """Raises for a pooling request that can never be served (:func:`.admission.check_pooling`)."""
        check_pooling(prompt_token_ids, vocab_size=int(self.runner.model.vocab_size),
                      max_model_len=self.max_model_len)

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
                self.max_model_len, grammar=matcher), stops=TokenStops(
                params, len(prompt_token_ids), self.eos_token_ids, self.max_model_len, matcher))
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
        """Stops the request's sequences (all ``n``) and frees their blocks now; returns the
        updates built so far (with the overlap, the last chunks may come later)."""
        for seq in self.scheduler.abort_request(request_id):
            self._end(seq.seq_id, FinishReason.ABORT)
        return self._take()

    def set_update_sink(self, sink: Sink | None) -> None:
        """Sends every update to ``sink`` as soon as it is built (on the thread that built it)
        instead of returning it from ``complete``/``abort``/``step``: the async engine's delivery,
        which thus sees each request's updates in order whichever thread built them."""
        self._output.set_sink(sink)

    @property
    def virtual_engines(self) -> list[LLMEngine]:
        """The engines the async engine runs a step loop for: this one (``engine.virtual_engines``
        has several)."""
        return [self]

    def has_unfinished(self) -> bool:
        """Sequences to step, output work not delivered yet, or a tensor-parallel rank gone
        (the next step raises why)."""
        return self.scheduler.has_unfinished() or self._output.busy or self.runner.ranks_failed

    def rebuild(self) -> LLMEngine:
        """A fresh engine after a step failed in a way no single request explains: a new KV
        pool, block manager and scheduler (the requests of this one are dropped: fail them).

        The loaded weights are reused: nothing writes them after loading (every forward pass
        runs under inference_mode and only writes activations and the KV pool), so a step that
        raised cannot have left them half-changed. A fault that broke the device itself (a
        CUDA error poisons the whole context) makes the new pool's probe forward pass raise,
        and then only a new process helps. Runs on the step thread, like ``step``."""
        self.close_outputs()
        self.runner.reset_kv_cache()
        if self.proposer is not None:
            self.proposer.reset()
        return LLMEngine(self.config, self.tokenizer, runner=self.runner, grammars=self.grammars,
                         proposer=self.proposer)

    def close_outputs(self) -> None:
        """Stops the output thread (the engine is being replaced; jobs not started are dropped)."""
        self._output.close()

    # ---- the step loop -----------------------------------------------------------------------

    def step(self) -> list[SequenceUpdate]:
        return self.complete(self.launch())

    def launch(self) -> LaunchedStep:
        """Schedules and starts the model work (with pipeline stages it is still in flight when
        this returns: see :class:`LaunchedStep`); nothing changes this engine until ``complete``."""
        self.runner.raise_if_ranks_failed()  # a dead rank fails the step (rebuild: new ranks)
        started = time.perf_counter()
        self._settle()  # outputs the output jobs ended so far are not scheduled again
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running, self.block_manager)
        scheduled = self.scheduler.schedule()
        for seq_id, reason in scheduled.rejected:
            self._end(seq_id, FinishReason.ERROR, error=reason)
        updates = self._take()
        if scheduled.is_empty:
            return LaunchedStep(scheduled, None, updates, started)
        self._note_first_scheduled(scheduled)
        return LaunchedStep(scheduled, self.runner.launch(scheduled, self.virtual_engine), updates,
                            started)

    def complete(self, launched: LaunchedStep) -> list[SequenceUpdate]:
        """Finishes the step's model work and hands its outputs to an output job; returns the
        updates built so far (all of this step's without the overlap)."""
        scheduled, updates = launched.scheduled, launched.updates
        if launched.in_flight is None:  # nothing to compute: what is left is output work
            self._output.wait()
            self._settle()
            return updates + self._take()
        model_output = self.runner.finish(launched.in_flight)
        background = scheduled.num_background_tokens
        self.scheduler.background.observe(scheduled.num_batched_tokens - background, background,
                                          scheduled.busy, time.perf_counter() - launched.started)
        self._output.wait()  # the jobs of earlier steps, which ran while this step's model did
        self._settle()
        self._fail_pinned(scheduled, model_output)
        self.scheduler.update(scheduled, model_output)
        self._record_stats(scheduled)
        self._submit_outputs(model_output)
        self._settle()  # without the overlap: a stop string's blocks are freed now
        return updates + self._take()

    def _take(self) -> list[SequenceUpdate]:
        return self._output.take()

    def _settle(self) -> None:
        """Finishes in the scheduler (frees) the outputs that output jobs ended (stop strings,
        output-processing faults), unless something finished them already."""
        for state in self._output.reap():
            if self._outputs.get(state.seq.seq_id) is state:
                self._finish(state)

    def _fail_pinned(self, scheduled: SchedulerOutput, output: ModelOutput) -> None:
        """Finishes the sequences whose own sampling failed (before ``scheduler.update``, which
        then skips them: they got no token)."""
        for item in scheduled.scheduled:
            if item.seq_id in output.errors and item.seq_id in self._outputs:
                self._fail(self._outputs[item.seq_id], output.errors[item.seq_id])

    def _finish(self, state: OutputState) -> None:
        self.scheduler.finish(state.seq)
        self._release_proposals(state.seq.seq_id)
        del self._outputs[state.seq.seq_id]

    def _release_proposals(self, seq_id: int) -> None:
        """A finished sequence's speculative state goes at once (a draft model's pool blocks)."""
        if self.proposer is not None:
            self.proposer.release(seq_id)

    def _fail(self, state: OutputState, failure: Failure) -> None:
        """Finishes the output with an error and frees its blocks now; its last chunk is built
        without its output processor, which may be what failed."""
        self._finish(state)
        num_output_tokens = len(state.seq.output_token_ids)
        self._output.submit(lambda: ([] if state.done else
                                     [error_update(state, failure, num_output_tokens)], []))

    def _submit_outputs(self, output: ModelOutput) -> None:
        """The step side of the step's outputs: pooled vectors end their sequences, sampled
        tokens go through the token-id rules (an output they end is finished now); the chunks
        are one output job's work, in the order the updates always came."""
        for seq_id, records in output.prompt_logprobs.items():
            if seq_id in self._outputs:
                self._outputs[seq_id].pending_prompt_logprobs.extend(records)
        parts: list[Callable[[], JobResult]] = []
        for seq_id, vector in output.pooled.items():
            if seq_id in self._outputs:  # else aborted while the step ran
                state = self._outputs[seq_id]
                self._finish(state)
                parts.append(partial(_final, state, FinishReason.STOP, None, vector))
        if output.pooled:
            self.stats.num_pooled_seqs += len(output.pooled)
            self.stats.max_pooled_per_step = max(self.stats.max_pooled_per_step, len(output.pooled))
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
            batch = self._token_batch(state, token_ids, logprobs)
            if batch is not None:
                parts.append(partial(emit_batch, batch))
        if parts:
            self._output.submit(partial(run_parts, parts))

    def _token_batch(self, state: OutputState, token_ids: list[int],
                     logprobs: list[Any]) -> TokenBatch | None:
        """The tokens this step added to the output as the token-id rules accept them (a stop
        among several verified proposals ends it there, the rest are dropped); finishes the
        output when they end it. None when that check itself failed (the output failed)."""
        assert state.stops is not None, "a pooling sequence never samples"
        try:
            num_kept, finish = state.stops.accept(token_ids)
        except Exception as exc:  # e.g. its grammar's process: this sequence's alone
            self._fail(state, pinned_fault(state, "output processing", exc))
            return None
        if finish is not None:
            self._finish(state)
        prompt_logprobs = None
        if state.pending_prompt_logprobs and state.seq.params.prompt_logprobs is not None:
            prompt_logprobs = tuple(state.pending_prompt_logprobs)
            state.pending_prompt_logprobs = []
        return TokenBatch(state, token_ids[:num_kept], logprobs[:num_kept], finish,
                          prompt_logprobs, len(state.seq.output_token_ids))

    def _note_first_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.monotonic()
        for item in scheduled.scheduled:
            state = self._outputs[item.seq_id]
            if state.first_scheduled_time is None:
                state.first_scheduled_time = now

    def _record_stats(self, scheduled: SchedulerOutput) -> None:
        record_step(self.stats, scheduled, {seq_id: state.seq for seq_id, state in self._outputs.items()},
                    self.scheduler.running, self.block_manager.block_size)

    def _end(self, seq_id: int, reason: FinishReason, error: str | None = None) -> None:
        """Ends an output from outside its tokens (abort, rejection): finished in the scheduler
        now (a no-op when it finished it itself), its last chunk built by an output job."""
        state = self._outputs.pop(seq_id)
        self.scheduler.finish(state.seq)  # a no-op when the scheduler finished it itself
        self._release_proposals(seq_id)
        self._output.submit(partial(_final, state, reason, error, None))

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


def _final(state: OutputState, reason: FinishReason, error: str | None, pooled: Any) -> JobResult:
    return final_update(state, reason, error, pooled), []
