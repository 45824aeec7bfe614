"""Output processing overlapped with the next step (``--async-output-processing``).

After each step, every sampled token goes through two kinds of work:

- what the scheduler must know before the next step: whether the output ended on a token id (EOS,
  a stop token id, ``max_tokens``, the context length, a grammar's end). It is cheap and decided
  from ids alone (``TokenStops``), so it stays on the step thread, and the blocks of an output
  that ended are freed before the next step is scheduled, as without overlap;
- what the client sees: detokenizing, stop strings, the chunk (``OutputProcessor.emit``). It is
  Python work per token; on a GPU the device would idle while it runs. With the overlap it runs
  here, on one dedicated output thread, while the step thread launches and runs the next step.

Why a thread of the engine's own rather than the async engine's event loop: the event loop also
serves every HTTP request and stream, which detokenizing would hold up; a thread inside the engine
keeps the offline API (``LLMEngine.step``) and every virtual engine of a pipeline the same as
the async engine; and the torch step thread spends its time in kernels (or, on CUDA, waiting for
the device) with the GIL released, which is exactly when the output thread can have it. On a CPU,
torch's intra-op threads already use every core during the forward pass, so the output thread
competes with them: whether it pays there is measured (docs/performance.md), and ``auto`` turns
it on only on CUDA.

Ordering. Every chunk is built by a job run in submission order (one thread, or inline when the
overlap is off), including the last chunk of an abort, a rejection or a failure: so a request's
chunks come in the order they would without the overlap, and an output's last chunk is its only
last chunk (``OutputState.done``). The step thread submits a step's job after waiting for the jobs
before it (they ran while this step's model work did), so an output that a stop string ends is
known to the engine before the step after next is scheduled: it runs one step more at most, whose
tokens are never emitted (its blocks are freed then). Usage counts what was emitted, as before.

A job's exception for one output fails that output alone (``pinned_fault``); an exception outside
any output's work is re-raised on the step thread by the next ``reap``/``wait`` (the step fails as
a whole and the engine is rebuilt).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from llmplatform.engine.config import ASYNC_OUTPUT_MODES
from llmplatform.engine.isolation import pinned_fault
from llmplatform.engine.outputs import Failure, SequenceUpdate
from llmplatform.sampling.output_processor import OutputProcessor, TokenStops
from llmplatform.sampling.outputs import FinishReason, GenerateChunk, TokenLogprob, Usage

if TYPE_CHECKING:
    import numpy as np

    from llmplatform.engine.sequence import Sequence

logger = logging.getLogger("llmplatform.engine")


def resolve_async_output(mode: str, device_type: str) -> bool:
    """``auto``: on for CUDA, where the device would otherwise idle while Python detokenizes; off
    on CPU, where the benchmark measured no gain (docs/performance.md, "Output processing")."""
    if mode not in ASYNC_OUTPUT_MODES:
        raise ValueError(f"async output processing must be one of {', '.join(ASYNC_OUTPUT_MODES)}, "
                         f"got {mode!r}")
    return device_type == "cuda" if mode == "auto" else mode == "on"


@dataclass
class OutputState:
    """The engine's record of one output (one sequence) until it finishes."""

    seq: Sequence  # the scheduler's sequence, which the engine made: to finish it
    # Turns its tokens into chunks (detokenizing, stops); None for a pooling sequence. Used by
    # output jobs only, once the step side made the state.
    processor: OutputProcessor | None
    # The token-id finishing rules, decided on the step thread (None for a pooling sequence).
    stops: TokenStops | None = None
    pending_prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # step side
    # When a step first scheduled the sequence (time.monotonic()), sent on its first chunk so the
    # worker can tell queue time from compute time.
    first_scheduled_time: float | None = None
    first_scheduled_time_sent: bool = False  # output side
    done: bool = False  # output side: its last chunk was built (nothing more is emitted)

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def index(self) -> int:
        return self.seq.index


@dataclass(frozen=True)
class TokenBatch:
    """What a step added to one output, as the step side accepted it (``TokenStops``)."""

    state: OutputState
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    token_finish: FinishReason | None
    prompt_logprobs: tuple[TokenLogprob, ...] | None
    num_output_tokens: int  # the sequence's tokens after this step: an error chunk's usage


# A job's answer: the updates it built, in order, and the outputs it ended that the step side has
# not (a stop string, an output-processing fault): the engine finishes those in the scheduler.
JobResult = tuple[list[SequenceUpdate], list[OutputState]]


def emit_batch(batch: TokenBatch) -> JobResult:
    """The output side of one output's step: its chunk (see the module docstring)."""
    state = batch.state
    if state.done:  # a stop string ended it a step ago: these tokens are past the stop
        return [], []
    try:
        chunk = _token_chunk(batch)
    except Exception as exc:  # detokenizing, stop handling: this output's alone
        failure = pinned_fault(state, "output processing", exc)
        return [error_update(state, failure, batch.num_output_tokens)], [state]
    ended = []
    if chunk.finish_reason is not None:
        state.done = True
        if batch.token_finish is None:
            ended.append(state)
    return [SequenceUpdate(state.request_id, state.index, chunk)], ended


def run_parts(parts: list[Callable[[], JobResult]]) -> JobResult:
    """One job of several parts (a step's outputs), their updates in order."""
    updates: list[SequenceUpdate] = []
    ended: list[OutputState] = []
    for part in parts:
        part_updates, part_ended = part()
        updates += part_updates
        ended += part_ended
    return updates, ended


def _token_chunk(batch: TokenBatch) -> GenerateChunk:
    state = batch.state
    assert state.processor is not None, "a pooling sequence never samples"
    records = batch.logprobs if all(r is not None for r in batch.logprobs) else None
    chunk = state.processor.emit(batch.token_ids, records, batch.token_finish)
    if batch.prompt_logprobs:
        chunk = replace(chunk, prompt_logprobs=batch.prompt_logprobs)
    if not state.first_scheduled_time_sent:
        chunk = replace(chunk, first_scheduled_time=state.first_scheduled_time)
        state.first_scheduled_time_sent = True
    return chunk


def error_update(state: OutputState, failure: Failure, num_output_tokens: int) -> SequenceUpdate:
    """An output's last update when it failed; built without its processor (which may be what
    failed)."""
    state.done = True
    seq = state.seq
    chunk = GenerateChunk(request_id=seq.request_id, text="", token_ids=(),
                          usage=Usage(seq.num_prompt_tokens, num_output_tokens),
                          finish_reason=FinishReason.ERROR, error=failure.message,
                          error_code=failure.error_code)
    return SequenceUpdate(seq.request_id, seq.index, chunk)


def final_update(state: OutputState, reason: FinishReason, error: str | None = None,
                 pooled: np.ndarray | None = None) -> list[SequenceUpdate]:
    """The last update of an output the engine ends (abort, rejection, a pooled vector); none
    when a job ended it already (its last chunk is out)."""
    if state.done:
        return []
    state.done = True
    seq = state.seq
    if state.processor is not None:
        chunk = state.processor.finish(reason, error=error)
    else:
        chunk = GenerateChunk(request_id=seq.request_id, text="", token_ids=(),
                              usage=Usage(seq.num_prompt_tokens, 0), finish_reason=reason,
                              error=error)
    if pooled is not None:
        chunk = replace(chunk, first_scheduled_time=state.first_scheduled_time)
    return [SequenceUpdate(seq.request_id, seq.index, chunk, pooled=pooled)]


Sink = Callable[[list[SequenceUpdate]], None]


class OutputPipeline:
    """Runs output jobs in submission order: inline (the overlap off) or on one thread of its
    own. Updates go to the sink when one is set (the async engine's delivery, called on the
    thread that ran the job), else to an outbox that :meth:`take` empties."""

    def __init__(self, threaded: bool, name: str = "engine-output") -> None:
        self.threaded = threaded
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None
        self._lock = threading.Lock()
        self._pending: list[Future[None]] = []
        self._outbox: list[SequenceUpdate] = []
        self._ended: list[OutputState] = []
        self._sink: Sink | None = None
        self._error: BaseException | None = None

    def set_sink(self, sink: Sink | None) -> None:
        """Where updates go from now on (after what is in the outbox)."""
        with self._lock:
            self._sink = sink
            waiting, self._outbox = self._outbox, []
        if sink is not None and waiting:
            sink(waiting)

    def submit(self, job: Callable[[], JobResult]) -> None:
        if self._executor is None:
            self._run(job)
            return
        self._pending.append(self._executor.submit(self._run, job))

    def _run(self, job: Callable[[], JobResult]) -> None:
        try:
            updates, ended = job()
        except BaseException as exc:  # not one output's fault: the step side re-raises it
            with self._lock:
                self._error = self._error or exc
            return
        with self._lock:
            self._ended.extend(ended)
            sink = self._sink
            if sink is None:
                self._outbox.extend(updates)
        if sink is not None and updates:
            sink(updates)

    def wait(self) -> None:
        """Blocks until every job submitted so far has run."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def reap(self) -> list[OutputState]:
        """The outputs finished jobs ended (see :data:`JobResult`), each once; raises a job's
        failure outside any output's work."""
        self._pending = [f for f in self._pending if not f.done()]
        with self._lock:
            ended, self._ended = self._ended, []
            error, self._error = self._error, None
        if error is not None:
            raise error
        return ended

    def take(self) -> list[SequenceUpdate]:
        """The updates built so far and not yet taken (none while a sink is set)."""
        with self._lock:
            updates, self._outbox = self._outbox, []
        return updates

    @property
    def busy(self) -> bool:
        """Jobs not run yet, or updates not taken yet."""
        return any(not f.done() for f in self._pending) or bool(self._outbox) or bool(self._ended)

    def close(self) -> None:
        """Drops the jobs not started (the engine is being replaced)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
