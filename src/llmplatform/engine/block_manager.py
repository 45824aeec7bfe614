"""The paged KV cache's bookkeeping: which blocks of a fixed pool hold each sequence's tokens.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots each; block ids are
``0 .. num_blocks - 1``. A sequence's ``block_table`` lists its blocks in token order, so the KV of
token ``position`` lives in slot ``block_table[position // block_size] * block_size +
position % block_size``::

    block_size = 4, block_table = [7, 2, 5], 10 tokens
    positions  0  1  2  3 | 4  5  6  7 | 8  9  .  .
    slots     28 29 30 31 | 8  9 10 11 |20 21 22 23     (block 5 is partly filled)

Blocks are reference counted. ``fork`` makes a child share its parent's blocks (parallel sampling,
``n`` > 1). A shared block is never written in place: the sequence about to write its next token
into a shared block first gets a private copy (copy-on-write), and ``allocate_slots`` returns the
``(src, dst)`` pair so that the model runner copies the KV data before the forward pass.

Free-pool order is deterministic so that tests can name exact block ids. The pool is a FIFO: it
starts as ``0, 1, ..., num_blocks - 1``; allocation takes from the front; a block whose reference
count drops to 0 is appended at the back. ``free(seq)`` releases a sequence's blocks tail first, so
of one sequence's blocks the tail ones are reused first and its first blocks (the prompt prefix,
the part a prefix cache would reuse) stay unreused in the pool longest.

Pure Python, no torch: the model runner owns the KV tensors; this class owns only the ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from llmplatform.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    # ---- pool facts ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def max_num_tokens(self) -> int:
        """Token slots in the whole pool: the longest sequence that could ever fit."""
        return self.num_blocks * self.block_size

    @property
    def free_block_ids(self) -> list[int]:
        """The free pool, next to be allocated first."""
        return list(self._free_block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits the pool when it is alone in it."""
        return num_tokens <= self.max_num_tokens

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ---- per-sequence operations -------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_total_tokens: int) -> int:
        """Free blocks ``allocate_slots(seq, num_total_tokens)`` would take.

        That is: the blocks missing from ``seq.block_table`` for slots of tokens
        ``[0, num_total_tokens)``, plus one if the block that receives the next written token
        (position ``seq.num_computed_tokens``) is shared and must be copied first.
        """
        num_missing = max(0, self.num_blocks_for(num_total_tokens) - len(seq.block_table))
        num_copies = 0 if self._shared_write_index(seq, num_total_tokens) is None else 1
        return num_missing + num_copies

    def allocate_slots(self, seq: Sequence, num_total_tokens: int) -> list[tuple[int, int]]:
        """Give ``seq`` slots for tokens ``[0, num_total_tokens)``; return the blocks to copy.

        The tokens to be written are ``[seq.num_computed_tokens, num_total_tokens)``. If the block
        receiving the first of them is shared, a free block ``dst`` replaces it in the table (the
        shared ``src`` loses one reference) and ``[(src, dst)]`` is returned: the runner must copy
        ``src`` into ``dst`` before the forward pass writes into ``dst``. Then missing blocks are
        appended to the table, taken from the front of the free pool. The caller checks
        ``can_allocate(blocks_needed(...))`` first.
        """
        num_needed = self.blocks_needed(seq, num_total_tokens)
        assert num_needed <= self.num_free_blocks, f"{num_needed} blocks needed, {self.num_free_blocks} free"
        blocks_to_copy = []
        index = self._shared_write_index(seq, num_total_tokens)
        if index is not None:
            src = seq.block_table[index]
            dst = self._take_free_block()
            self._ref_counts[src] -= 1
            seq.block_table[index] = dst
            blocks_to_copy.append((src, dst))
        # Only the block holding the first written token can be shared: the blocks after it were
        # allocated for this sequence alone.
        start = seq.num_computed_tokens // self.block_size
        assert all(self._ref_counts[b] == 1 for b in seq.block_table[start:]), "writing a shared block"
        while len(seq.block_table) < self.num_blocks_for(num_total_tokens):
            seq.block_table.append(self._take_free_block())
        return blocks_to_copy

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first; blocks no one references return to the pool."""
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make ``child`` share every block of ``parent`` (one more reference each)."""
        assert not child.block_table, "forking into a sequence that holds blocks"
        for block_id in parent.block_table:
            self._ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)

    def slot(self, seq: Sequence, position: int) -> int:
        """The KV slot of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Assert the pool matches the tables of ``live_seqs`` (every sequence holding blocks).

        Each block's reference count equals the number of tables listing it (so the counts sum to
        the tables' total length); the free pool holds, once each, exactly the unreferenced blocks
        (so free + used == num_blocks).
        """
        expected = [0] * self.num_blocks
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"repeated block in {seq.block_table}"
            for block_id in seq.block_table:
                expected[block_id] += 1
        assert expected == self._ref_counts, f"ref counts {self._ref_counts}, tables say {expected}"
        free = set(self._free_block_ids)
        assert len(free) == len(self._free_block_ids), f"duplicate in free pool {self.free_block_ids}"
        assert free == {b for b, count in enumerate(expected) if count == 0}, "free pool != unreferenced blocks"

    # ---- internals ---------------------------------------------------------------------------

    def _shared_write_index(self, seq: Sequence, num_total_tokens: int) -> int | None:
        """Table index of the shared block the next written token lands in, if there is one."""
        if num_total_tokens <= seq.num_computed_tokens:
            return None  # nothing to write
        index = seq.num_computed_tokens // self.block_size
        if index < len(seq.block_table) and self._ref_counts[seq.block_table[index]] > 1:
            return index
        return None

    def _take_free_block(self) -> int:
        block_id = self._free_block_ids.popleft()
        assert self._ref_counts[block_id] == 0
        self._ref_counts[block_id] = 1
        return block_id
