"""BlockManager under a sliding window: which blocks are freed when, what stays, and that fork,
free, preemption and the prefix cache keep the pool consistent around the placeholders."""

from __future__ import annotations

import pytest

from llmplatform.engine.block_manager import FREED_BLOCK, BlockManager
from tests.unit.test_block_manager import compute, make_seq, release


def step(bm: BlockManager, seq, num_total_tokens: int) -> int:
    """One step as the scheduler runs it: allocate, compute, offer to the cache, free the dead."""
    compute(bm, seq, num_total_tokens)
    bm.cache_full_blocks(seq)
    return bm.free_out_of_window(seq)


def test_frees_a_block_once_no_future_query_can_see_any_of_its_tokens():
    # Window 6, blocks of 4: the next query at p sees p-5..p; block 0 (tokens 0-3) dies once
    # p - 5 > 3, i.e. with 9 tokens computed (the next query at 9 sees 4..9).
    bm = BlockManager(num_blocks=16, block_size=4, attention_window=6, enable_prefix_caching=False)
    seq = make_seq(8)
    assert step(bm, seq, 8) == 0
    assert seq.block_table == [0, 1]
    seq.output_token_ids.append(1)
    assert step(bm, seq, 9) == 1
    assert seq.block_table == [FREED_BLOCK, 1, 2] and bm.num_held_blocks(seq) == 2
    assert bm.free_block_ids[-1] == 0  # back to the pool's back
    bm.check_invariants([seq])
    for n in range(10, 14):  # the next query at 13 sees 8..13: block 1 (4-7) is dead too
        seq.output_token_ids.append(1)
        step(bm, seq, n)
    assert seq.block_table == [FREED_BLOCK, FREED_BLOCK, 2, 3]
    bm.check_invariants([seq])
    release(bm, seq)


def test_a_sequence_holds_about_a_window_however_long_it_grows():
    bm = BlockManager(num_blocks=64, block_size=4, attention_window=16, enable_prefix_caching=False)
    seq = make_seq(5)
    step(bm, seq, 5)
    most = 0
    for n in range(6, 400):
        seq.output_token_ids.append(7)
        step(bm, seq, n)
        most = max(most, bm.num_held_blocks(seq))
        bm.check_invariants([seq])
    assert len(seq.block_table) == 100 and most == 16 // 4 + 1
    release(bm, seq)


def test_a_chunk_keeps_what_its_first_query_sees():
    """After a chunk, the next chunk's first query (at num_computed_tokens) still sees the window
    before it: only blocks wholly before that go."""
    bm = BlockManager(num_blocks=32, block_size=4, attention_window=10, enable_prefix_caching=False)
    seq = make_seq(40)
    step(bm, seq, 16)  # next query at 16 sees 7..16: block 0 (0-3) dies, block 1 (4-7) holds 7
    assert seq.block_table[:2] == [FREED_BLOCK, 1]
    step(bm, seq, 32)  # next query at 32 sees 23..32: blocks 0-4 (0-19) die, block 5 (20-23) stays
    assert seq.block_table[:6] == [FREED_BLOCK] * 5 + [5]
    bm.check_invariants([seq])
    release(bm, seq)


def test_forked_children_share_the_live_blocks_and_free_their_own_references():
    bm = BlockManager(num_blocks=32, block_size=4, attention_window=4, enable_prefix_caching=False)
    parent, child = make_seq(13), make_seq(13)
    step(bm, parent, 12)  # next query at 12 sees 9..12: blocks 0 and 1 die
    assert parent.block_table == [FREED_BLOCK, FREED_BLOCK, 2]
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens  # as the scheduler's fork does
    assert child.block_table == parent.block_table and bm.ref_count(2) == 2
    bm.check_invariants([parent, child])
    for seq in (parent, child):
        step(bm, seq, 13)  # the shared block 2 is partly filled by neither: no copy, one new block each
    bm.check_invariants([parent, child])
    for seq in (parent, child):
        seq.output_token_ids.extend([1, 2, 3, 4])
        step(bm, seq, 17)  # next query at 17 sees 14..17: block 2 (8-11) dies for both
    assert bm.ref_count(2) == 0 and 2 in bm.free_block_ids
    bm.check_invariants([parent, child])
    release(bm, parent, child)


def test_freed_blocks_stay_cached_and_a_later_prompt_hits_them_while_they_last():
    bm = BlockManager(num_blocks=32, block_size=4, attention_window=4)
    first = make_seq(20)
    step(bm, first, 20)  # next query at 20 sees 17..20: blocks 0-3 die, cached
    assert first.block_table == [FREED_BLOCK] * 4 + [4]
    assert all(bm.block_hash(b) is not None for b in range(4))
    same_prompt = make_seq(20)
    cached = bm.find_cached_prefix(same_prompt, 19)
    assert cached == [0, 1, 2, 3]  # all still present: a whole prefix
    bm.take_cached_prefix(same_prompt, cached)
    step(bm, same_prompt, 20)
    bm.check_invariants([first, same_prompt])
    release(bm, first, same_prompt)


def test_preemption_frees_what_is_left_and_a_recompute_starts_over():
    bm = BlockManager(num_blocks=16, block_size=4, attention_window=5, enable_prefix_caching=False)
    seq = make_seq(17)
    step(bm, seq, 17)
    bm.free(seq)  # what the scheduler's preemption does
    seq.num_computed_tokens = 0
    bm.check_invariants([])
    assert bm.num_free_blocks == 16 and seq.block_table == []
    step(bm, seq, 17)
    assert bm.num_held_blocks(seq) == 2
    release(bm, seq)


def test_without_a_window_nothing_is_freed():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(40)
    assert step(bm, seq, 40) == 0 and FREED_BLOCK not in seq.block_table
    release(bm, seq)


def test_rejects_a_bad_window():
    with pytest.raises(ValueError):
        BlockManager(8, 4, attention_window=0)
