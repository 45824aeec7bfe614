"""Pooling requests: a prompt run forward for its final hidden states, not for a next token.

A decoder embedding model (e5-mistral, gte-Qwen2 style) is the plain Llama/Qwen2 network whose
vector is a pool of the last layer's hidden states after the final norm: the last prompt
position's (``last``, what those models use, with the EOS their tokenizer appends) or the mean
over every prompt position (``mean``), optionally L2-normalized.

In the engine such a request is one :class:`~llmplatform.engine.sequence.Sequence` with
``pooling`` set. It obeys the same invariant as every sequence (its computed tokens catch up with
its tokens), prefill chunks included, but it never samples: the chunk that computes its last
prompt token yields its vector instead, and the engine finishes it in that same step (its blocks
are freed at once; it never decodes).

Chunked prefill is kept for pooling requests (a prompt longer than the step's token budget is
computed over several steps, as any prompt): refusing to chunk them would cap embedding inputs
at ``max_num_batched_tokens`` and would break the scheduler's rule that only the last running
sequence has an unfinished prefill. Instead the pooler (:mod:`.pooler`) carries what ``mean``
needs across chunks, a float32 running sum of the chunk's rows, in the runner's record of the
sequence (``RunnerSequence.pooling_sum``); ``last`` needs only the final chunk.

Prefix caching: a cache hit skips computing the cached positions, so ``mean`` pooling requests
never look up the prefix cache (like prompt-logprob requests); ``last`` pooling may, since the
last position is always computed (the scheduler leaves at least one token to compute) over the
very K/V the cached blocks hold. A preempted pooling sequence is recomputed from position 0,
which restarts its running sum.

Pure Python, no torch (the scheduler imports it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingMode(str, enum.Enum):
    LAST = "last"
    """The last prompt position's final hidden state."""
    MEAN = "mean"
    """The mean of every prompt position's final hidden state."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PoolingParams:
    mode: PoolingMode = PoolingMode.LAST
    normalize: bool = True
    """L2-normalize the pooled vector (what e5-mistral and gte-Qwen2 users compare with)."""

    @property
    def uses_every_position(self) -> bool:
        """True when the vector needs every prompt position computed (no prefix-cache reuse)."""
        return self.mode is PoolingMode.MEAN
