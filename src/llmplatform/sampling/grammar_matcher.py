"""One sequence's walk through its grammar, and masking a batch of logits rows.

See :mod:`.grammar` for how these fit the engine's step (it re-exports them): per step, the
engine fills one bitmask row per constrained sequence (:func:`fill_bitmasks`), the sampler masks
only those rows (:func:`apply_bitmask`), and each sampled token advances its sequence's
:class:`SequenceGrammar`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterable, Sequence

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from llmplatform.sampling.grammar import CompiledGrammar


class SequenceGrammar:
    """One sequence's progress through its grammar (one per sequence; n>1 samples each get their
    own from the shared :class:`CompiledGrammar`). Not thread-safe; the engine's step thread owns
    it."""

    def __init__(self, compiled: CompiledGrammar, *,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        """``stop_token_ids``: replaces the compiler's (the model's EOS) for this sequence, e.g.
        EOS plus a request's own stop ids."""
        self.compiled = compiled
        self._stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self._matcher = xgr.GrammarMatcher(compiled.handle,
                                           override_stop_tokens=self._stop_token_ids)
        self._accepted: list[int] = []

    @property
    def accepted_token_ids(self) -> tuple[int, ...]:
        return tuple(self._accepted)

    @property
    def num_accepted(self) -> int:
        return len(self._accepted)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._matcher.stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32, from
        :func:`allocate_bitmask`). After termination only the stop tokens are allowed, so a
        sequence that is (wrongly) scheduled again ends at once instead of failing the batch."""
        if self._matcher.is_terminated():
            allow_only(bitmask, row, self._matcher.stop_token_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False: the grammar does not allow it (the mask was not
        applied, or the matcher already terminated); the state is then unchanged."""
        accepted = self._matcher.accept_token(int(token_id))
        if accepted:
            self._accepted.append(int(token_id))
        return accepted

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete and nothing more may follow."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if not 0 <= num_tokens <= len(self._accepted):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._accepted)} tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._accepted[-num_tokens:]

    def replay(self, token_ids: Sequence[int]) -> None:
        """Rebuild the state from scratch by accepting ``token_ids`` (the sequence's output so
        far). Raises ValueError if one of them is not allowed: they were not produced under this
        grammar."""
        self._matcher.reset()
        self._accepted.clear()
        for i, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                raise ValueError(f"token {token_id} at output position {i} is not allowed by "
                                 "the grammar")

    def fork(self) -> SequenceGrammar:
        """An independent copy at the same position."""
        twin = SequenceGrammar.__new__(SequenceGrammar)
        twin.compiled = self.compiled
        twin._stop_token_ids = self._stop_token_ids
        twin._matcher = self._matcher.fork()
        twin._accepted = list(self._accepted)
        return twin


# ---------------------------------------------------------------------------- batch masking

def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 on CPU, all tokens allowed."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


_batch_matcher: xgr.BatchGrammarMatcher | None = None
_batch_lock = threading.Lock()


def fill_bitmasks(rows: Sequence[tuple[int, SequenceGrammar]], bitmask: torch.Tensor
                  ) -> list[int]:
    """Fill ``bitmask[row]`` for each (row, grammar); returns the rows to mask, for
    :func:`apply_bitmask`. Several local rows are filled in parallel by xgrammar's batch
    matcher; a :class:`~.grammar_sandbox.RemoteGrammar` row copies the mask its sandbox
    computed (:func:`~.grammar_sandbox.fill_remote_grammars`, run first, fetches them all in one
    round trip; a row it did not fetch costs a round trip of its own)."""
    global _batch_matcher
    indices = [row for row, _ in rows]
    remote = [(row, grammar) for row, grammar in rows if not isinstance(grammar, SequenceGrammar)]
    if remote:  # matchers in a grammar process (grammar_sandbox): one round trip for them all
        for row, grammar in remote:
            grammar.fill_bitmask(bitmask, row)
        rows = [(row, grammar) for row, grammar in rows if isinstance(grammar, SequenceGrammar)]
    if len(rows) == 1:
        rows[0][1].fill_bitmask(bitmask, rows[0][0])
    elif rows:
        live = [(row, grammar) for row, grammar in rows if not grammar.is_terminated()]
        for row, grammar in rows:
            if grammar.is_terminated():
                grammar.fill_bitmask(bitmask, row)
        with _batch_lock:
            if _batch_matcher is None:
                _batch_matcher = xgr.BatchGrammarMatcher()
            _batch_matcher.batch_fill_next_token_bitmask(
                [grammar._matcher for _, grammar in live], bitmask, [row for row, _ in live])
    return indices


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: Sequence[int]
                  ) -> None:
    """Set to -inf, in place, every token ``bitmask`` forbids in ``logits[row]`` for each row in
    ``row_indices``; other rows are untouched. logits: [num_rows, vocab_size] float32/bf16/fp16
    on any device; bitmask: [>= num_rows, ceil(vocab_size / 32)] int32 (moved to the logits'
    device if needed)."""
    if not row_indices:
        return
    num_rows, vocab_size = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= vocab_size, (
        bitmask.shape, logits.shape)
    assert max(row_indices) < min(num_rows, bitmask.shape[0]), (row_indices, logits.shape)
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size,
                                    indices=list(row_indices))


def allow_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """Set ``bitmask[row]`` to allow exactly ``token_ids``."""
    bitmask[row].zero_()
    for token_id in token_ids:
        word, bit = divmod(int(token_id), 32)
        # int32 words: bit 31 is the sign bit, so build the word's value as a signed integer.
        value = int(bitmask[row, word]) & 0xFFFF_FFFF | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
