"""N-gram proposals (prompt lookup): a sequence's next tokens guessed from its own history.

Text that is rewritten, edited, summarised or quoted repeats runs of its input. If the last ``n``
tokens of a sequence (prompt + output) occurred earlier in it, the tokens that followed that
earlier occurrence are a good guess for what follows now. For ``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``, the most recent earlier occurrence of the last ``n`` tokens is
looked up and the (up to) K tokens after it proposed; no match for any ``n``: no proposal.

It runs on the step thread every step, so the lookup is one vectorised comparison per ``n``
(numpy over a sliding window of the history), not a Python loop over positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llmplatform.engine.config import SpeculativeConfig

if TYPE_CHECKING:
    from llmplatform.engine.block_manager import BlockManager
    from llmplatform.engine.sequence import Sequence


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    of ``token_ids`` (``max_n`` .. ``min_n`` tokens long) that occurred before; [] when none did.
    ``token_ids``: 1-d integer array (the history)."""
    num_tokens = len(token_ids)
    if k < 1:
        return []
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = token_ids[num_tokens - n:]
        # Windows starting at 0 .. num_tokens - n - 1: each is followed by at least one token
        # (the suffix itself, starting at num_tokens - n, is not a candidate).
        windows = sliding_window_view(token_ids[:num_tokens - 1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n
            return token_ids[start:start + k].tolist()
    return []


def decoding_sequences(running: Seq[Sequence]) -> list[Sequence]:
    """Clears every running sequence's proposals and returns those in decode: one token left to
    compute, at least one output token (not a prefill, chunked or after preemption), generating."""
    decoding = []
    for seq in running:
        seq.spec_token_ids.clear()
        seq.spec_draft_probs = None
        if seq.num_uncomputed_tokens == 1 and seq.output_token_ids and seq.pooling is None:
            decoding.append(seq)
    return decoding


class ProposalRoom:
    """How many tokens each decoding sequence may be proposed this step, shared by the methods.

    Speculation is off for the whole step when more than ``disable_by_batch_size`` sequences
    decode, and for a sequence with an output grammar (its mask for proposal ``j`` needs the
    grammar advanced through proposals ``< j``, which the grammar process does not do). A
    sequence's K is capped so that its accepted tokens and the model's own never pass
    ``max_tokens`` or the context, and the step's proposals so that every decoding sequence still
    fits the token budget (a prefill chunk gets what is left), the step stays within
    ``max_step_rows`` (the most rows a step of decodes may have and still run on the runner's
    small-row kernels, ``ModelOps.small_rows`` on the CPU's fused decode path: beyond it a step's
    projections take the general product, several times slower per row; None: no such limit),
    and their slots fit the free KV blocks left after every decode's own (speculation never
    preempts anyone)."""

    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int,
                 max_model_len: int, max_step_rows: int | None = None) -> None:
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_step_rows = max_step_rows

    def allot(self, decoding: list[Sequence], block_manager: BlockManager
              ) -> Iterator[tuple[Sequence, int, Callable[[int], int]]]:
        """Yields ``(seq, k, take)`` for each sequence that may be proposed ``k >= 1`` tokens, in
        order; the caller proposes up to ``k`` and calls ``take(n)`` with the number it keeps,
        which returns ``n`` or fewer if their KV slots do not fit (the caller keeps that many)."""
        if not decoding or len(decoding) > self.config.disable_by_batch_size:
            return
        spare_budget = min(self.max_num_batched_tokens, self.max_step_rows or self.max_num_batched_tokens
                           ) - len(decoding)
        bm = block_manager
        spare_blocks = bm.num_free_blocks - sum(
            max(0, bm.num_blocks_for(seq.num_tokens) - len(seq.block_table)) for seq in decoding)
        for seq in decoding:
            if spare_budget <= 0:
                return
            if seq.grammar is not None:
                continue
            k = min(self.config.num_speculative_tokens, spare_budget,
                    seq.params.max_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k < 1:
                continue
            held = max(len(seq.block_table), bm.num_blocks_for(seq.num_tokens))

            def take(n: int, seq: Sequence = seq, held: int = held) -> int:
                nonlocal spare_blocks, spare_budget
                while n and bm.num_blocks_for(seq.num_tokens + n) - held > spare_blocks:
                    n -= 1
                spare_blocks -= max(0, bm.num_blocks_for(seq.num_tokens + n) - held)
                spare_budget -= n
                return n

            yield seq, k, take


class NgramProposer:
    """Sets, each step, the proposals of the scheduler's running sequences (``spec_token_ids``)
    from their own history (``ngram_lookup``), within the room :class:`ProposalRoom` leaves."""

    def __init__(self, config: SpeculativeConfig, room: ProposalRoom) -> None:
        self.config = config
        self.room = room

    def propose(self, running: Seq[Sequence], block_manager: BlockManager) -> int:
        """Proposes for each running sequence in decode, within the room, and clears every
        other's (:class:`ProposalRoom`). Returns the number of tokens proposed."""
        num_proposed = 0
        for seq, k, take in self.room.allot(decoding_sequences(running), block_manager):
            history = np.fromiter(seq.all_token_ids(), dtype=np.int64, count=seq.num_tokens)
            proposal = ngram_lookup(history, self.config.prompt_lookup_min,
                                    self.config.prompt_lookup_max, k)
            del proposal[take(len(proposal)):]
            seq.spec_token_ids.extend(proposal)
            num_proposed += len(proposal)
        return num_proposed

    def reset(self) -> None:
        """Nothing is kept between steps."""

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""
