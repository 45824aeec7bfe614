"""A sequence: one stream of tokens the engine computes (a request with ``n`` > 1 has several).

The invariant the whole engine is built on: ``num_computed_tokens`` catches up with
``num_tokens``. Prefill, chunked prefill, decode and recompute after preemption are the same
thing: the scheduler gives each running sequence some of its not-yet-computed tokens each step;
when a step computes a sequence's last uncomputed token, the model samples one more token for it.
Pure Python (no torch): the scheduler and block manager are tested without a model.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmplatform.engine.pooling import PoolingParams
from llmplatform.sampling.params import SamplingParams

if TYPE_CHECKING:
    from llmplatform.sampling.grammar_matcher import SequenceGrammar
    from llmplatform.sampling.grammar_sandbox import RemoteGrammar

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # not admitted yet, or preempted (holds no blocks)
    RUNNING = "running"    # admitted: holds blocks for its computed tokens
    FINISHED = "finished"  # done (stop, length, abort or error): holds no blocks


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    # Index of this sequence among its request's n outputs.
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    # Prefix caching, owned by the block manager. block_hashes[i]: the chained hash of full
    # block i of this sequence's tokens (computed lazily; tokens never change, so they stay valid
    # across preemption). num_cached_blocks: the leading blocks of block_table already offered to
    # the prefix cache (a cache hit's blocks count as offered).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_cached_blocks: int = 0
    # The request's cache_salt: seeds block_hashes[0], so only sequences with the same salt
    # share cached blocks (engine.prefix_cache). None: unsalted.
    cache_salt: str | None = None
    # The LoRA adapter it runs with (``engine.lora``: an id unique per adapter load), None: the
    # base model. It salts block_hashes[0] like cache_salt.
    lora_id: int | None = None
    # How this output samples, beyond ``params`` (the model runner's, set by the engine): its own
    # seed (derived from the request's: the n outputs of a seeded request differ, reproducibly),
    # the token ids that end it (EOS + params.stop_token_ids) and its walk through its output
    # grammar (structured outputs), if any.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    grammar: SequenceGrammar | RemoteGrammar | None = None
    # A pooling sequence (engine.pooling): it computes its prompt for a pooled vector and never
    # samples; None for generation.
    pooling: PoolingParams | None = None
    # The request's priority (vLLM's field): lower runs first; every output of a request has its
    # request's. The scheduler keeps its queues in this order (engine.scheduler).
    priority: int = 0
    # Speculative decoding (engine.speculative): tokens proposed for this step, to be verified
    # after its last token. Never part of its tokens (``num_tokens``); only a running sequence in
    # decode holds any, and only between the proposal and the step's update.
    spec_token_ids: list[int] = field(default_factory=list)
    # The distributions a draft model drew them from (a [K, vocab] tensor, kept opaque here), or
    # None when they are certain (the n-gram method, or a greedy sequence's draft argmax).
    spec_draft_probs: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` (prompt and output alike)."""
        return token_ids_in(self.prompt_token_ids, self.output_token_ids, start, end)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def token_ids_in(prompt_token_ids: list[int], output_token_ids: list[int], start: int, end: int) -> list[int]:
    """Tokens at positions ``[start, end)`` of a prompt followed by its output (the scheduler's
    sequences and the runner's copies of them alike), without concatenating the two."""
    n = len(prompt_token_ids)
    if end <= n:
        return prompt_token_ids[start:end]
    if start >= n:
        return output_token_ids[start - n:end - n]
    return prompt_token_ids[start:] + output_token_ids[:end - n]
