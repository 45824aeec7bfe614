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

Free-pool order is deterministic so that tests can name exact block ids. The free pool is one
queue ordered by eviction priority: it starts as ``0, 1, ..., num_blocks - 1``; allocation takes
from the front; a block whose reference count drops to 0 is appended at the back. ``free(seq)``
releases a sequence's blocks tail first, so of one sequence's blocks the tail ones are reused first
and its first blocks (the prompt prefix, the part most worth keeping) stay in the pool longest.

Prefix caching (``enable_prefix_caching``; :mod:`llmplatform.engine.prefix_cache` has the hashes).
Once a full block of a sequence has been computed (``cache_full_blocks``, after each step), it is
registered under its chained hash. A freed block keeps its hash and KV: it sits in the free pool,
still cached, until allocation reaches it at the front of the queue, which *evicts* it (drops the
hash) and hands it out. The queue's order is therefore the LRU order of eviction::

    free pool (front = evicted first):  [ 9  4* 5* 6* ]     * = cached (has a hash)
    a new sequence hits 4 and 5:        [ 9  6* ]           4 and 5 leave the pool, ref 1
    it allocates one more block:        [ 6* ]              9 (no hash) is taken first
    it finishes, tail first:            [ 6*  9  5* 4* ]    its prefix blocks are evicted last

A sequence admitted with nothing computed takes the blocks of its longest cached prefix
(``find_cached_prefix`` then ``take_cached_prefix``): each gets one more reference (shared by any
number of sequences, like a fork) and leaves the free pool if it was there; those tokens count as
computed. Cached blocks are full and never written again, so sharing them needs no copy-on-write.

Blocks in flight. ``allocate_slots`` also notes, by hash, the full blocks a sequence is about to
compute (its table covers them, its computed tokens do not yet); ``cache_full_blocks`` after the
step, or ``free``, clears them. Between a step's scheduling and its update, then,
``num_in_flight_blocks`` tells a waiting sequence how many of the blocks right after its cached
prefix another sequence is computing in that very step: the scheduler defers it one step rather
than compute the same prefix twice (engine.scheduler). Only sequences holding blocks have blocks in
flight, and each of them computes them in the step that allocated them, so nothing waits on a
waiting sequence and no note outlives its step.

Sliding windows (``attention_window`` W: the model's every layer attends to its last W positions
only, ``LlamaForCausalLM.attention_window``). A query at position p sees keys ``p - W < j <= p``,
and a sequence's next query is at ``num_computed_tokens`` (the first of a prefill chunk, or its
next decode), so after each step ``free_out_of_window`` drops the sequence's blocks whose every
token is at or before ``num_computed_tokens - W``: no future query of it can see them. Their
table entries become ``FREED_BLOCK`` (positions keep their index; the kernels never read an entry
before the window, and the runner's copy of the table may still name the old block, which may by
then belong to someone else). A sequence so holds about ``W / block_size + 1`` blocks, plus its
chunk. Freed blocks go to the free pool like any other: a hashed one stays cached (evictable),
so a later prompt sharing the prefix still hits it while it lasts, and a hit always covers a whole
prefix of present blocks (the chain of hashes breaks at the first evicted one).

Pure Python, no torch: the model runner owns the KV tensors; this class owns only the ids.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from llmplatform.engine.prefix_cache import (BlockHash, PrefixCache, PrefixCacheStats,
                                             hash_block_tokens, salt_root)
from llmplatform.engine.sequence import Sequence

FREED_BLOCK = -1
"""A block-table entry whose block was freed as out of the attention window (never read)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *,
                 enable_prefix_caching: bool = True, attention_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if attention_window is not None and attention_window < 1:
            raise ValueError(f"attention_window must be at least 1 or None, got {attention_window}")
        self.attention_window = attention_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # The free pool in eviction order (front first); an ordered dict so that a cache hit can
        # pull a block out of the middle in O(1).
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache = PrefixCache(num_blocks) if enable_prefix_caching else None
        self.prefix_cache_stats = PrefixCacheStats()
        # Blocks in flight (see the module docstring): how many sequences are computing each hash
        # now, and per sequence id the end of its in-flight blocks, which run from its
        # num_cached_blocks (the blocks before it are computed and offered to the cache).
        self._in_flight: Counter[BlockHash] = Counter()
        self._in_flight_end: dict[int, int] = {}

    # ---- pool facts ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached ones included: they are evictable)."""
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
        """The free pool, next to be allocated (and evicted) first."""
        return list(self._free_block_ids)

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix block now (in use or free)."""
        return len(self.prefix_cache) if self.prefix_cache is not None else 0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is cached under, if it is cached."""
        return self.prefix_cache.hash_of(block_id) if self.prefix_cache is not None else None

    @staticmethod
    def num_held_blocks(seq: Sequence) -> int:
        """Blocks ``seq`` references (its table less the entries freed as out of the window)."""
        return sum(1 for b in seq.block_table if b != FREED_BLOCK)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits the pool when it is alone in it."""
        return num_tokens <= self.max_num_tokens

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ---- per-sequence operations -------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_total_tokens: int,
                      cached_block_ids: list[int] | None = None) -> int:
        """Free blocks ``allocate_slots(seq, num_total_tokens)`` would take.

        That is: the blocks missing from ``seq.block_table`` for slots of tokens
        ``[0, num_total_tokens)``, plus one if the block that receives the next written token
        (position ``seq.num_computed_tokens``) is shared and must be copied first. With
        ``cached_block_ids`` (for a sequence holding nothing, before ``take_cached_prefix``): the
        blocks missing after that prefix, plus the prefix's blocks that are now in the free pool
        (taking them removes them from it).
        """
        if cached_block_ids:
            assert not seq.block_table and seq.num_computed_tokens == 0
            num_missing = max(0, self.num_blocks_for(num_total_tokens) - len(cached_block_ids))
            return num_missing + sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
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
        # allocated for this sequence alone (cached blocks are full: never written again).
        start = seq.num_computed_tokens // self.block_size
        assert all(self._ref_counts[b] == 1 for b in seq.block_table[start:]), "writing a shared block"
        while len(seq.block_table) < self.num_blocks_for(num_total_tokens):
            seq.block_table.append(self._take_free_block())
        # Slots for proposals (engine.speculative) past the sequence's tokens are never in flight:
        # their tokens may be rejected.
        self._note_in_flight(seq, min(num_total_tokens, seq.num_tokens) // self.block_size)
        return blocks_to_copy

    def truncate(self, seq: Sequence) -> int:
        """Drop ``seq``'s blocks past those holding its computed tokens (after a speculative
        step, the slots of the proposals it rejected: engine.speculative); returns how many.
        Those blocks were allocated for ``seq`` alone in that step (never shared, never cached)."""
        num_kept = self.num_blocks_for(seq.num_computed_tokens)
        dropped = seq.block_table[num_kept:]
        for block_id in reversed(dropped):
            assert self._ref_counts[block_id] == 1 and self.block_hash(block_id) is None
            self._release(block_id)
        del seq.block_table[num_kept:]
        return len(dropped)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first; blocks no one references return to the pool
        (cached ones keep their hash until they are evicted). Its blocks are no longer in flight."""
        self._clear_in_flight(seq, len(seq.block_table))
        for block_id in reversed(seq.block_table):
            if block_id != FREED_BLOCK:
                self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def free_out_of_window(self, seq: Sequence) -> int:
        """Drop ``seq``'s references to the blocks no query from position
        ``seq.num_computed_tokens`` on can see (all their tokens at or before
        ``num_computed_tokens - attention_window``); their entries become ``FREED_BLOCK``. Called
        after each step, once ``cache_full_blocks`` has offered them to the prefix cache. Returns
        how many entries it freed (0 without a window)."""
        if self.attention_window is None:
            return 0
        num_dead = max(0, seq.num_computed_tokens - self.attention_window + 1) // self.block_size
        assert num_dead <= seq.num_cached_blocks or self.prefix_cache is None, "freeing an unoffered block"
        # Entries are freed from the front, so the live ones start after the last freed one; the
        # later blocks go first, so the earlier (prefix) ones are evicted last.
        index, freed = num_dead - 1, 0
        while index >= 0 and seq.block_table[index] != FREED_BLOCK:
            self._release(seq.block_table[index])
            seq.block_table[index] = FREED_BLOCK
            index, freed = index - 1, freed + 1
        return freed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make ``child`` (whose tokens are a copy of ``parent``'s) share every block of
        ``parent``, one more reference each, and its prefix-cache state."""
        assert not child.block_table, "forking into a sequence that holds blocks"
        assert (child.cache_salt, child.lora_id) == (parent.cache_salt, parent.lora_id), \
            "the hashes shared are the salt's and the adapter's"
        for block_id in parent.block_table:
            if block_id != FREED_BLOCK:
                self._ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = parent.block_hashes[:child.num_tokens // self.block_size]

    def slot(self, seq: Sequence, position: int) -> int:
        """The KV slot of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- prefix caching ----------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence, max_num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``'s tokens that covers at most
        ``max_num_tokens`` tokens (full blocks only). Changes nothing."""
        if self.prefix_cache is None:
            return []
        num_blocks = min(max_num_tokens, seq.num_tokens) // self.block_size
        return self.prefix_cache.longest_prefix(self._block_hashes(seq, num_blocks))

    def take_cached_prefix(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """``seq`` (holding nothing) takes the blocks ``find_cached_prefix`` found, one more
        reference each; the tokens they hold count as computed. Records the lookup in
        ``prefix_cache_stats`` (a miss is an empty list)."""
        assert self.prefix_cache is not None and not seq.block_table and seq.num_computed_tokens == 0
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_block_ids[block_id]
            self._ref_counts[block_id] += 1
        seq.block_table = list(cached_block_ids)
        seq.num_cached_blocks = len(cached_block_ids)
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        stats = self.prefix_cache_stats
        stats.num_queries += 1
        stats.num_queried_tokens += seq.num_tokens
        stats.num_hit_tokens += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are full and computed but not offered yet (called
        after a step advanced ``seq.num_computed_tokens``). A block whose prefix some other
        block caches already stays uncached."""
        if self.prefix_cache is None:
            return
        num_full_blocks = seq.num_computed_tokens // self.block_size
        if num_full_blocks <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, num_full_blocks)
        for index in range(seq.num_cached_blocks, num_full_blocks):
            self.prefix_cache.register(seq.block_table[index], hashes[index])
        self._clear_in_flight(seq, num_full_blocks)
        seq.num_cached_blocks = num_full_blocks

    def num_in_flight_blocks(self, seq: Sequence, num_cached_blocks: int, max_num_tokens: int) -> int:
        """How many of waiting ``seq``'s full blocks, right after its first ``num_cached_blocks``
        (its cached prefix) and within its first ``max_num_tokens`` tokens, other sequences are
        computing now (in flight: allocated, hash known, KV not written yet). ``seq`` holds no
        blocks, so the blocks counted are others'. Changes nothing but ``seq``'s hash memo."""
        if not self._in_flight:
            return 0
        assert not seq.block_table, "only a sequence holding nothing waits for others' blocks"
        num_blocks = min(max_num_tokens, seq.num_tokens) // self.block_size
        num_in_flight = 0
        for block_hash in self._block_hashes(seq, num_blocks)[num_cached_blocks:]:
            if block_hash not in self._in_flight:
                break
            num_in_flight += 1
        return num_in_flight

    @property
    def num_in_flight_hashes(self) -> int:
        """Distinct full-block hashes some sequence is computing now (0 between steps)."""
        return len(self._in_flight)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: the next lookup misses. Blocks in use keep their data (their
        sequences run on); free ones become plain free blocks."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache_stats.num_resets += 1

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Assert the pool matches the tables of ``live_seqs`` (every sequence holding blocks).

        Each block's reference count equals the number of tables listing it (so the counts sum to
        the tables' total length); the free pool holds, once each, exactly the unreferenced blocks
        (so free + used == num_blocks). With prefix caching, a cached block in a table sits at an
        index where the table's sequence has that very hash, and the blocks in flight are exactly
        those the live sequences noted, each past its offered blocks and within its table.
        """
        live_seqs = list(live_seqs)
        expected = [0] * self.num_blocks
        for seq in live_seqs:
            held = [b for b in seq.block_table if b != FREED_BLOCK]
            assert len(set(held)) == len(held), f"repeated block in {seq.block_table}"
            num_freed = len(seq.block_table) - len(held)
            assert all(b == FREED_BLOCK for b in seq.block_table[:num_freed]), \
                f"freed entries not a prefix of {seq.block_table}"
            if num_freed:
                window = self.attention_window
                assert window is not None and num_freed * self.block_size <= seq.num_computed_tokens - window + 1, \
                    f"seq {seq.seq_id}: {num_freed} blocks freed, {seq.num_computed_tokens} computed"
            for block_id in held:
                expected[block_id] += 1
            if self.prefix_cache is not None:
                for index, block_id in enumerate(seq.block_table):
                    if block_id == FREED_BLOCK:
                        continue
                    block_hash = self.prefix_cache.hash_of(block_id)
                    if block_hash is not None:
                        assert index < len(seq.block_hashes) and seq.block_hashes[index] == block_hash, \
                            f"cached block {block_id} at index {index} of a sequence with other tokens"
        assert expected == self._ref_counts, f"ref counts {self._ref_counts}, tables say {expected}"
        in_flight: Counter[BlockHash] = Counter()
        live_ids = set()
        for seq in live_seqs:
            live_ids.add(seq.seq_id)
            end = self._in_flight_end.get(seq.seq_id)
            if end is not None:
                assert seq.num_cached_blocks < end <= len(seq.block_table), \
                    f"seq {seq.seq_id}: blocks in flight up to {end}, {seq.num_cached_blocks} cached"
                in_flight.update(seq.block_hashes[seq.num_cached_blocks:end])
        assert set(self._in_flight_end) <= live_ids, "blocks in flight for a sequence holding none"
        assert in_flight == self._in_flight, "in-flight hash counts out of sync"
        free = set(self._free_block_ids)
        assert free == {b for b, count in enumerate(expected) if count == 0}, "free pool != unreferenced blocks"
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()

    # ---- internals ---------------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks (extends the
        sequence's memo as needed)."""
        hashes, size = seq.block_hashes, self.block_size
        assert num_blocks * size <= seq.num_tokens
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            # The first block chains from the sequence's salt and adapter: others never match it.
            parent = hashes[-1] if hashes else salt_root(seq.cache_salt, seq.lora_id)
            hashes.append(hash_block_tokens(parent, seq.token_ids_in(start, start + size)))
        return hashes[:num_blocks]

    def _note_in_flight(self, seq: Sequence, num_full_blocks: int) -> None:
        """``seq``'s first ``num_full_blocks`` blocks will be full once this step computes them:
        those past its computed ones are in flight."""
        if self.prefix_cache is None:
            return
        start = self._in_flight_end.get(seq.seq_id, seq.num_cached_blocks)
        if num_full_blocks <= start:
            return
        self._in_flight.update(self._block_hashes(seq, num_full_blocks)[start:])
        self._in_flight_end[seq.seq_id] = num_full_blocks

    def _clear_in_flight(self, seq: Sequence, num_blocks: int) -> None:
        """``seq``'s blocks before ``num_blocks`` are no longer in flight (computed, or freed)."""
        end = self._in_flight_end.get(seq.seq_id)
        if end is None:
            return
        for block_hash in seq.block_hashes[seq.num_cached_blocks:min(end, num_blocks)]:
            self._in_flight[block_hash] -= 1
            if not self._in_flight[block_hash]:
                del self._in_flight[block_hash]
        if num_blocks >= end:
            del self._in_flight_end[seq.seq_id]

    def _shared_write_index(self, seq: Sequence, num_total_tokens: int) -> int | None:
        """Table index of the shared block the next written token lands in, if there is one."""
        if num_total_tokens <= seq.num_computed_tokens:
            return None  # nothing to write
        index = seq.num_computed_tokens // self.block_size
        if index < len(seq.block_table) and self._ref_counts[seq.block_table[index]] > 1:
            return index
        return None

    def _release(self, block_id: int) -> None:
        """One reference fewer; a block no one references returns to the pool's back."""
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self._ref_counts[block_id] == 0:
            self._free_block_ids[block_id] = None

    def _take_free_block(self) -> int:
        """Allocate the front of the free pool, evicting its cached prefix block if it holds one."""
        block_id, _ = self._free_block_ids.popitem(last=False)
        assert self._ref_counts[block_id] == 0
        if self.prefix_cache is not None and self.prefix_cache.drop(block_id):
            self.prefix_cache_stats.num_evicted_blocks += 1
        self._ref_counts[block_id] = 1
        return block_id
