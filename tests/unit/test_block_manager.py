"""BlockManager: exact block ids, free-pool order, reference counts and copy-on-write."""

from __future__ import annotations

import pytest

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.sequence import Sequence
from llmplatform.sampling.params import SamplingParams


def make_seq(num_prompt_tokens: int) -> Sequence:
    return Sequence("req", list(range(100, 100 + num_prompt_tokens)), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_total_tokens: int) -> list[tuple[int, int]]:
    """What the scheduler + engine do for one chunk: allocate, then the tokens get computed."""
    copies = bm.allocate_slots(seq, num_total_tokens)
    seq.num_computed_tokens = num_total_tokens
    return copies


def release(bm: BlockManager, *seqs: Sequence) -> None:
    for seq in seqs:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0


def test_fresh_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.free_block_ids == [0, 1, 2, 3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.max_num_tokens == 32
    assert bm.can_ever_fit(32) and not bm.can_ever_fit(33)
    assert [bm.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    bm.check_invariants([])


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_rejects_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_allocation_takes_from_the_front():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(10), make_seq(5)
    assert bm.blocks_needed(a, 10) == 3
    assert compute(bm, a, 10) == []
    assert compute(bm, b, 5) == []
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert bm.free_block_ids == [5, 6, 7]
    assert bm.usage == 5 / 8
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.check_invariants([a, b])
    release(bm, a, b)


def test_chunked_allocation_grows_the_table_only_at_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(9)
    assert compute(bm, seq, 3) == [] and seq.block_table == [0]
    assert bm.blocks_needed(seq, 4) == 0
    compute(bm, seq, 4)
    assert seq.block_table == [0]
    assert bm.blocks_needed(seq, 5) == 1
    compute(bm, seq, 5)
    assert seq.block_table == [0, 1]
    assert bm.blocks_needed(seq, 9) == 1  # tokens 5..8: block 1 has room for 5..7, 8 needs a new one
    compute(bm, seq, 9)
    assert seq.block_table == [0, 1, 2]
    assert bm.blocks_needed(seq, 9) == 0  # nothing to write
    release(bm, seq)


def test_free_releases_tail_first_to_the_back_of_the_pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(10), make_seq(5)
    compute(bm, a, 10)
    compute(bm, b, 5)
    bm.free(a)
    assert a.block_table == []
    assert bm.free_block_ids == [5, 6, 7, 2, 1, 0]
    bm.check_invariants([b])
    # The never-used blocks go first, then a's tail block, its prefix blocks last.
    c, d = make_seq(12), make_seq(8)
    compute(bm, c, 12)
    compute(bm, d, 8)
    assert c.block_table == [5, 6, 7] and d.block_table == [2, 1]
    assert bm.free_block_ids == [0]
    bm.check_invariants([b, c, d])
    bm.free(b)
    assert bm.free_block_ids == [0, 4, 3]
    release(bm, c, d)
    assert bm.free_block_ids == [0, 4, 3, 7, 6, 5, 1, 2]


def test_slot():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(8), make_seq(4)
    compute(bm, a, 8)
    compute(bm, b, 4)
    bm.free(a)  # free pool: 3 4 5 6 7 1 0
    c = make_seq(10)
    compute(bm, c, 10)
    assert c.block_table == [3, 4, 5]
    assert [bm.slot(c, p) for p in range(10)] == [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    assert bm.slot(b, 3) == 11
    release(bm, b, c)


def test_fork_shares_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(6), make_seq(6)
    compute(bm, parent, 6)
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and child.block_table is not parent.block_table
    assert [bm.ref_count(i) for i in (0, 1, 2)] == [2, 2, 0]
    assert bm.free_block_ids == [2, 3, 4, 5, 6, 7]
    bm.check_invariants([parent, child])
    bm.free(parent)  # the child still holds both blocks: nothing returns to the pool
    assert [bm.ref_count(i) for i in (0, 1)] == [1, 1]
    assert bm.free_block_ids == [2, 3, 4, 5, 6, 7]
    bm.check_invariants([child])
    release(bm, child)
    assert bm.free_block_ids == [2, 3, 4, 5, 6, 7, 1, 0]


def test_copy_on_write_of_the_shared_partly_filled_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child1, child2 = make_seq(6), make_seq(6), make_seq(6)
    compute(bm, parent, 5)  # blocks [0, 1]; block 1 holds token 4 only
    for child in (child1, child2):
        bm.fork(parent, child)
        child.num_computed_tokens = 5
    assert [bm.ref_count(i) for i in (0, 1)] == [3, 3]
    # Token 5 goes into shared block 1: the writer gets a copy.
    assert bm.blocks_needed(parent, 6) == 1
    assert compute(bm, parent, 6) == [(1, 2)]
    assert parent.block_table == [0, 2]
    assert [bm.ref_count(i) for i in (0, 1, 2)] == [3, 2, 1]
    assert bm.blocks_needed(child1, 6) == 1
    assert compute(bm, child1, 6) == [(1, 3)]
    assert child1.block_table == [0, 3]
    assert [bm.ref_count(i) for i in (0, 1, 2, 3)] == [3, 1, 1, 1]
    # The last holder owns block 1 alone now: it writes in place.
    assert bm.blocks_needed(child2, 6) == 0
    assert compute(bm, child2, 6) == []
    assert child2.block_table == [0, 1]
    assert bm.free_block_ids == [4, 5, 6, 7]
    bm.check_invariants([parent, child1, child2])
    release(bm, parent, child1, child2)
    assert bm.free_block_ids == [4, 5, 6, 7, 2, 3, 1, 0]


def test_copy_on_write_then_growth_in_one_allocation():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(9), make_seq(9)
    compute(bm, parent, 5)
    bm.fork(parent, child)
    child.num_computed_tokens = 5
    # Tokens 5..8: the copy of block 1 is taken first, then a new block for token 8.
    assert bm.blocks_needed(child, 9) == 2
    assert compute(bm, child, 9) == [(1, 2)]
    assert child.block_table == [0, 2, 3] and parent.block_table == [0, 1]
    assert [bm.ref_count(i) for i in range(4)] == [2, 1, 1, 1]
    bm.check_invariants([parent, child])
    release(bm, parent, child)


def test_no_copy_when_the_next_token_starts_a_new_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(5), make_seq(5)
    compute(bm, parent, 4)  # block 0 is full: token 4 lands in a fresh block
    bm.fork(parent, child)
    child.num_computed_tokens = 4
    assert bm.blocks_needed(child, 5) == 1
    assert compute(bm, child, 5) == []
    assert child.block_table == [0, 1] and bm.ref_count(0) == 2
    bm.check_invariants([parent, child])
    release(bm, parent, child)


def test_allocating_more_than_is_free_is_a_bug():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(9)
    assert bm.blocks_needed(seq, 9) == 3 and not bm.can_allocate(3)
    with pytest.raises(AssertionError):
        bm.allocate_slots(seq, 9)
    assert seq.block_table == [] and bm.free_block_ids == [0, 1]


def test_check_invariants_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(4)
    compute(bm, seq, 4)
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_invariants([])  # seq holds block 0 but is not listed
    release(bm, seq)
