"""Prefix caching in the block manager: the hash chain, exact block ids reused, reference counts,
LRU eviction order, the one-token-left rule and reset (the scheduler with it, and random workloads
against a fake KV cache: test_prefix_caching_scheduler.py)."""

from __future__ import annotations

import hashlib
import itertools
import struct

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.prefix_cache import PrefixCache, hash_block_tokens
from llmplatform.engine.sequence import Sequence
from llmplatform.sampling.params import SamplingParams

SAMPLED = 7  # a generated token
_request_ids = itertools.count()


def make_seq(token_ids: list[int], params: SamplingParams | None = None) -> Sequence:
    return Sequence(f"req-{next(_request_ids)}", list(token_ids), params or SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_total_tokens: int) -> list[tuple[int, int]]:
    """What the scheduler + engine do for one chunk: allocate, compute, register full blocks."""
    copies = bm.allocate_slots(seq, num_total_tokens)
    seq.num_computed_tokens = num_total_tokens
    bm.cache_full_blocks(seq)
    return copies


def admit(bm: BlockManager, seq: Sequence, max_num_tokens: int | None = None) -> list[int]:
    """Look up and take the longest cached prefix (at least one token left to compute)."""
    cached = bm.find_cached_prefix(seq, seq.num_tokens - 1 if max_num_tokens is None else max_num_tokens)
    bm.take_cached_prefix(seq, cached)
    return cached


PROMPT = list(range(100, 110))  # 10 tokens: with block_size 4, two full blocks and a partial one


def h(*blocks: list[int]) -> bytes:
    """The chained hash of the last of ``blocks``."""
    parent = None
    for tokens in blocks:
        parent = hash_block_tokens(parent, tokens)
    assert parent is not None
    return parent


# ---- the hash chain ----------------------------------------------------------------------------


def test_hash_chain_is_sha256_of_the_parent_digest_and_the_tokens():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h0 == hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert h1 == hashlib.sha256(h0 + struct.pack("<4q", 5, 6, 7, 8)).digest()
    # Stable across processes and machines (no per-process hash seed): pinned values.
    assert h0.hex() == "73e200e2b048c86d4e8c86b86bf62bbda84c7384e34e250b01aa30ab29d234a4"
    assert h1.hex() == "d6c3196cb2db3ef52af9bf96fe85966089108e7e3524783840e64898b3da413e"
    # The same tokens after another prefix are another block.
    assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != h1
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1


def test_sequence_block_hashes_cover_full_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(PROMPT)
    compute(bm, seq, 10)
    assert seq.block_hashes == [h(PROMPT[0:4]), h(PROMPT[0:4], PROMPT[4:8])]
    assert seq.num_cached_blocks == 2


def test_prefix_cache_keeps_one_block_per_hash():
    cache = PrefixCache(num_blocks=4)
    x, y = h([1, 2]), h([3, 4])
    assert cache.register(2, x) and cache.register(2, x)  # again: no-op
    assert not cache.register(3, x)  # a duplicate stays an ordinary block
    assert cache.register(3, y)
    assert cache.longest_prefix([x, y, h([5, 6])]) == [2, 3]
    assert cache.longest_prefix([y, x]) == [3, 2] and cache.longest_prefix([h([0])]) == []
    assert cache.drop(2) and not cache.drop(2) and cache.hash_of(2) is None
    assert cache.longest_prefix([x, y]) == [] and len(cache) == 1
    cache.check_invariants()


# ---- the block manager ---------------------------------------------------------------------------


def test_full_computed_blocks_are_registered_partial_ones_are_not():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(PROMPT)
    compute(bm, seq, 3)
    assert bm.num_cached_blocks == 0 and seq.num_cached_blocks == 0
    compute(bm, seq, 9)  # blocks 0 and 1 full, block 2 holds token 8
    assert seq.block_table == [0, 1, 2]
    assert [bm.block_hash(b) for b in (0, 1, 2)] == [h(PROMPT[:4]), h(PROMPT[:4], PROMPT[4:8]), None]
    assert bm.num_cached_blocks == 2
    bm.check_invariants([seq])


def test_a_new_sequence_reuses_the_exact_cached_blocks_of_a_running_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(PROMPT)
    compute(bm, a, 10)
    b = make_seq(PROMPT[:8] + [1, 2, 3])  # shares two full blocks, then differs
    cached = bm.find_cached_prefix(b, 10)
    assert cached == [0, 1]
    assert bm.blocks_needed(b, 11, cached) == 1  # blocks 0 and 1 are in use: only token 8..10's block
    bm.take_cached_prefix(b, cached)
    assert b.block_table == [0, 1] and b.num_computed_tokens == 8 and b.num_cached_blocks == 2
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 0]
    assert compute(bm, b, 11) == []  # writing starts in a fresh block: no copy-on-write
    assert b.block_table == [0, 1, 3]
    stats = bm.prefix_cache_stats
    assert (stats.num_queries, stats.num_queried_tokens, stats.num_hit_tokens) == (1, 11, 8)
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.free_block_ids == [4, 5, 6, 7, 2]  # blocks 0 and 1 still held by b
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.free_block_ids == [4, 5, 6, 7, 2, 3, 1, 0]
    bm.check_invariants([])


def test_any_number_of_sequences_share_cached_blocks_by_reference_count():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(PROMPT)
    compute(bm, first, 10)
    sharers = [make_seq(PROMPT) for _ in range(3)]
    for seq in sharers:
        assert admit(bm, seq) == [0, 1]
        compute(bm, seq, 10)
    assert [s.block_table for s in sharers] == [[0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert [bm.ref_count(i) for i in range(6)] == [4, 4, 1, 1, 1, 1]
    bm.check_invariants([first, *sharers])
    for expected, seq in zip([3, 2, 1], [first, *sharers[:2]]):
        bm.free(seq)
        assert (bm.ref_count(0), bm.ref_count(1)) == (expected, expected)
    bm.free(sharers[2])
    assert bm.free_block_ids == [6, 7, 2, 3, 4, 5, 1, 0]
    assert bm.num_cached_blocks == 2  # still cached while free
    bm.check_invariants([])


def test_freed_blocks_stay_cached_until_allocation_evicts_them_lru_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(PROMPT)
    compute(bm, a, 10)
    bm.free(a)
    # Tail first: the partial block 2, then the prefix blocks, the first block last.
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8 and bm.usage == 0.0
    # 24 other tokens take the never-used blocks and a's partial block: nothing evicted.
    other = make_seq(list(range(500, 524)))
    assert admit(bm, other) == []
    compute(bm, other, 24)
    assert other.block_table == [3, 4, 5, 6, 7, 2] and bm.free_block_ids == [1, 0]
    assert bm.prefix_cache_stats.num_evicted_blocks == 0
    # Growing by one block evicts the least recently used cached block: block 1, a's second.
    compute(bm, other, 25)
    assert other.block_table[-1] == 1 and bm.block_hash(1) is None
    assert bm.prefix_cache_stats.num_evicted_blocks == 1
    # a's prompt now finds only its first block: the chain breaks at the evicted one.
    again = make_seq(PROMPT)
    assert bm.find_cached_prefix(again, 9) == [0]
    bm.free(other)
    bm.check_invariants([])


def test_a_hit_takes_blocks_out_of_the_free_pool_and_reuse_refreshes_their_recency():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(PROMPT)
    compute(bm, a, 10)
    bm.free(a)
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_seq(PROMPT[:8] + [1, 2])
    cached = bm.find_cached_prefix(b, 9)
    assert cached == [0, 1]
    # Both cached blocks are free: taking them costs two free blocks, plus one for tokens 8, 9.
    assert bm.blocks_needed(b, 10, cached) == 3
    bm.take_cached_prefix(b, cached)
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 2] and bm.num_free_blocks == 6
    assert [bm.ref_count(i) for i in (0, 1)] == [1, 1]
    compute(bm, b, 10)
    assert b.block_table == [0, 1, 3]
    bm.free(b)
    # Used again just now: the prefix goes to the back, behind block 2 (a's old tail).
    assert bm.free_block_ids == [4, 5, 6, 7, 2, 3, 1, 0]
    bm.check_invariants([])


def test_a_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(PROMPT[:8])  # exactly two full blocks
    compute(bm, a, 8)
    b = make_seq(PROMPT[:8])
    # At most 7 of 8 tokens may come from the cache: one full block, the second is recomputed.
    assert admit(bm, b) == [0]
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4
    compute(bm, b, 8)
    assert b.block_table == [0, 2]
    # Block 2 holds the same prefix as block 1, which is cached already: it stays uncached.
    assert bm.block_hash(2) is None and bm.block_hash(1) == b.block_hashes[1]
    c = make_seq(PROMPT[:9])  # one more token: both full blocks may come from the cache
    assert admit(bm, c) == [0, 1] and c.num_uncomputed_tokens == 1
    bm.check_invariants([a, b, c])


def test_generated_tokens_fill_blocks_that_are_cached_too():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(PROMPT[:6])
    compute(bm, a, 6)
    a.output_token_ids += [SAMPLED]
    compute(bm, a, 7)
    a.output_token_ids += [SAMPLED]
    compute(bm, a, 8)  # block 1 = prompt tokens 4, 5 and two generated tokens: full
    assert bm.block_hash(1) == h(PROMPT[:4], PROMPT[4:6] + [SAMPLED, SAMPLED])
    # The next turn of the conversation: the previous prompt and answer, then more.
    follow_up = make_seq(PROMPT[:6] + [SAMPLED, SAMPLED, 1, 2, 3])
    assert admit(bm, follow_up) == [0, 1]
    bm.check_invariants([a, follow_up])


def test_fork_shares_cached_blocks_and_the_hash_memo():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(PROMPT), make_seq(PROMPT)
    compute(bm, parent, 9)
    bm.fork(parent, child)
    assert child.block_table == [0, 1, 2] and child.num_cached_blocks == 2
    assert child.block_hashes == parent.block_hashes[:2]
    assert [bm.ref_count(i) for i in range(3)] == [2, 2, 2]
    bm.check_invariants([parent, child])


def test_reset_forgets_every_cached_block_and_the_next_lookup_misses():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(PROMPT), make_seq(list(range(200, 208)))
    compute(bm, a, 10)
    compute(bm, b, 8)
    bm.free(a)
    assert bm.num_cached_blocks == 4
    free_before = bm.free_block_ids
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and all(bm.block_hash(i) is None for i in range(8))
    assert bm.free_block_ids == free_before  # the pool itself is untouched
    c = make_seq(PROMPT)
    assert admit(bm, c) == [] and c.num_computed_tokens == 0
    stats = bm.prefix_cache_stats
    assert (stats.num_resets, stats.num_queries, stats.num_hit_tokens) == (1, 1, 0)
    # b runs on; its blocks were offered already and are not registered again.
    b.output_token_ids += [SAMPLED]
    compute(bm, b, 9)
    assert bm.num_cached_blocks == 0
    bm.check_invariants([b, c])


def test_without_prefix_caching_nothing_is_hashed_or_found():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(PROMPT)
    compute(bm, a, 10)
    assert not bm.enable_prefix_caching and bm.num_cached_blocks == 0 and a.block_hashes == []
    assert bm.find_cached_prefix(make_seq(PROMPT), 9) == []
    bm.free(a)
    assert bm.free_block_ids == [3, 4, 5, 6, 7, 2, 1, 0]
