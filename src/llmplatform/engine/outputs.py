"""The typed records that cross the engine's internal boundaries (contracts only, no logic).

    scheduler --SchedulerOutput--> model runner --ModelOutput--> engine update --SequenceUpdate--> caller

No live :class:`~llmplatform.engine.sequence.Sequence` crosses them: the scheduler owns its
sequences, and tells the runner about each by id. The first time the runner is to compute a
sequence (new, a forked child, or one resumed after preemption) the step carries a
:class:`NewSequenceData` with everything the runner keeps for it (its tokens, blocks and
sampling parameters); afterwards a :class:`CachedSequenceData` carries only what changed (its
computed tokens, its new blocks). The runner appends the tokens it samples itself, so tokens
never travel back. ``finished_seq_ids`` tells the runner which state to drop. This is the shape
of vLLM v1's ``SchedulerOutput`` (``NewRequestData`` / ``CachedRequestData``), smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmplatform.engine.pooling import PoolingParams
from llmplatform.errors import ErrorCode
from llmplatform.sampling.outputs import GenerateChunk, TokenLogprob
from llmplatform.sampling.params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from llmplatform.sampling.grammar_matcher import SequenceGrammar
    from llmplatform.sampling.grammar_sandbox import RemoteGrammar


@dataclass(frozen=True)
class NewSequenceData:
    """A sequence the runner has not computed yet, or one resumed after preemption (then the
    runner keeps its random stream and grammar walk, and takes the rest from here)."""

    seq_id: int
    request_id: str
    index: int  # which of its request's n outputs
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    params: SamplingParams
    seed: int | None  # this output's own seed (derived from the request's), None: unseeded
    stop_token_ids: tuple[int, ...]  # EOS + params.stop_token_ids
    grammar: SequenceGrammar | RemoteGrammar | None = None
    pooling: PoolingParams | None = None
    lora_id: int | None = None  # its adapter (engine.lora), None: the base model


@dataclass(frozen=True)
class CachedSequenceData:
    """A sequence the runner already holds: its block table from ``block_ids_from`` on is now
    ``new_block_ids`` (blocks appended, or a copy-on-write that replaced its last block)."""

    seq_id: int
    num_computed_tokens: int
    block_ids_from: int
    new_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of
    sequence ``seq_id`` (its ``num_computed_tokens`` is in its new or cached record).

    ``samples`` is True when this chunk reaches the end of the sequence's tokens: the model then
    samples the next token for it. A prefill chunk that stops short samples nothing, and neither
    does a pooling sequence's chunk (its last one yields its vector: ``ModelOutput.pooled``).
    """

    seq_id: int
    num_new_tokens: int
    samples: bool
    # Speculative decoding: the last ``len(spec_token_ids)`` of the chunk's tokens are these
    # proposals, not the sequence's tokens; the step verifies them (engine.speculative).
    spec_token_ids: tuple[int, ...] = ()
    # The draft model's distributions over them (``Sequence.spec_draft_probs``: rows of a tensor,
    # the first ``len(spec_token_ids)`` used), or None for certain proposals.
    spec_draft_probs: object | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    # The step's chunks, in batch order.
    scheduled: list[ScheduledChunk]
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    # Sequences the runner held that finished since the last step: drop their state.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Sequences preempted this step (their blocks were freed; they will be recomputed).
    preempted: list[int] = field(default_factory=list)
    # KV blocks to copy before the forward pass (copy-on-write of a shared, partly filled block).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Sequences rejected at admission because they can never fit (finished), with the reason.
    rejected: list[tuple[int, str]] = field(default_factory=list)
    # Waiting sequences deferred this step, for the first time since they queued, because another
    # sequence is computing the blocks after their cached prefix (engine.scheduler), each with the
    # number of those blocks. They stay waiting.
    deferred: list[tuple[int, int]] = field(default_factory=list)
    # Prompt tokens this step computes (prefill work; decode and recomputed output tokens not).
    num_prompt_tokens: int = 0
    # Tokens of background sequences (engine.priority), and whether foreground work was
    # unfinished when the step was scheduled: how engine.background judges the step's duration.
    num_background_tokens: int = 0
    busy: bool = False

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
    # Pooling sequences whose prompt this step finished: seq id -> their vector ([hidden]
    # float32; engine.pooling).
    pooled: dict[int, np.ndarray] = field(default_factory=dict)
    # Speculative decoding: seq id -> the proposals it accepted (and their logprob records, None
    # where not asked), which come before its token in ``token_ids``. A sequence that verified
    # proposals and accepted none is here with empty lists.
    accepted: dict[int, AcceptedTokens] = field(default_factory=dict)


@dataclass(frozen=True)
class AcceptedTokens:
    """A sequence's proposals the verification kept, in order (engine.speculative)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    num_proposed: int


@dataclass(frozen=True)
class SequenceUpdate:
    request_id: str
    index: int  # which of the request's n outputs
    chunk: GenerateChunk
    # A pooling sequence's vector ([hidden] float32), on its final update.
    pooled: np.ndarray | None = None


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
    # Prompt tokens computed (prefill work: a prompt shared by n outputs counts once; cached
    # prefixes and recomputed outputs not at all, a preempted prompt again).
    num_computed_prompt_tokens: int = 0
    # Speculative decoding (engine.speculative): sequence-steps that verified proposals, the
    # tokens proposed to them and the proposals accepted (each such step also yields one token of
    # the model's own, so it emits accepted / drafts + 1 tokens per sequence on average).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
