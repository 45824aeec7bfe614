"""The typed objects that cross the engine's internal boundaries (contracts only, no logic).

scheduler --SchedulerOutput--> model runner --ModelOutput--> engine update
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmplatform.engine.sequence import Sequence
from llmplatform.errors import ErrorCode
from llmplatform.sampling.outputs import TokenLogprob


@dataclass(frozen=True)
class ScheduledSequence:
    """Compute tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of ``seq``.

    ``samples`` is True when this chunk reaches the end of the sequence's tokens: the model then
    samples the next token for it. A prefill chunk that stops short samples nothing, and neither
    does a pooling sequence's chunk (its last one yields its vector: ``ModelOutput.pooled``).
    """

    seq: Sequence
    num_new_tokens: int
    samples: bool


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    # Sequences preempted this step (their blocks were freed; they will be recomputed).
    preempted: list[Sequence] = field(default_factory=list)
    # KV blocks to copy before the forward pass (copy-on-write of a shared, partly filled block).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests rejected at admission because they can never fit, with the reason.
    rejected: list[tuple[Sequence, str]] = field(default_factory=list)
    # Waiting sequences deferred this step, for the first time since they queued, because another
    # sequence is computing the blocks after their cached prefix (engine.scheduler), each with the
    # number of those blocks. They stay waiting.
    deferred: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class Failure:
    """Why one sequence failed alone: the message for its client and the FastChat error code
    (a 4xx one when the request itself is at fault, e.g. a grammar past its per-token budget)."""

    message: str
    error_code: int = ErrorCode.INTERNAL_ERROR


@dataclass(frozen=True)
class ModelOutput:
    """One sampled token per scheduled sequence that samples, in scheduling order, except for
    the sequences in ``errors``."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # Per sequence that asked for prompt logprobs and computed prompt tokens this step.
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # Sequences whose own work in the runner (sampling, prompt logprobs) raised: seq id -> the
    # error for their client. They got no token; the engine fails them alone.
    errors: dict[int, Failure] = field(default_factory=dict)
    # Pooling sequences whose prompt this step finished: seq id -> their vector ([hidden] float32
    # numpy array; engine.pooling).
    pooled: dict[int, Any] = field(default_factory=dict)
