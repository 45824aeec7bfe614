"""Scheduler: n > 1 forking (children sharing the prompt's blocks) and randomized workloads that
check every invariant, driven by a fake model (the basics: test_scheduler.py).

Every test ends with every sequence finished and every block back in the pool.
"""

from __future__ import annotations

import random

import pytest

from llmplatform.engine.sequence import Sequence, SequenceStatus
from tests.unit.scheduler_helpers import (SAMPLED, add, assert_drained, batch, finish_all,
                                          finish_done, make_scheduler, preempted, rejected, step)


# ---- n > 1 -----------------------------------------------------------------------------------


def test_n3_children_share_the_prompt_blocks_and_copy_the_partly_filled_one():
    sched = make_scheduler()
    bm = sched.block_manager
    parent, child1, child2 = group = add(sched, 6, n=3)
    assert list(sched.waiting) == [parent] and sched.num_waiting == 3
    # The parent's prefill stops at P - 1 = 5 tokens and samples nothing; then the children fork.
    out = step(sched)
    assert batch(out) == [(parent, 5, False)]
    assert sched.running == group and sched.num_waiting == 0
    assert [s.block_table for s in group] == [[0, 1]] * 3
    assert [s.num_computed_tokens for s in group] == [5, 5, 5]
    assert (bm.ref_count(0), bm.ref_count(1)) == (3, 3)
    # Each computes token 5 into block 1 (holding token 4 already): the first two writers copy it.
    out = step(sched)
    assert batch(out) == [(parent, 1, True), (child1, 1, True), (child2, 1, True)]
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [s.block_table for s in group] == [[0, 2], [0, 3], [0, 1]]
    assert [bm.ref_count(i) for i in range(4)] == [3, 1, 1, 1]
    assert [s.output_token_ids for s in group] == [[SAMPLED]] * 3
    out = step(sched)
    assert batch(out) == [(parent, 1, True), (child1, 1, True), (child2, 1, True)]
    assert out.blocks_to_copy == []
    finish_all(sched, *group)


def test_n3_prompt_a_multiple_of_block_size_still_copies():
    # P = 8: the fork point is 7 tokens, so block 1 is shared with 3 of its 4 slots filled.
    sched = make_scheduler()
    group = add(sched, 8, n=3)
    assert batch(step(sched)) == [(group[0], 7, False)]
    out = step(sched)
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [s.block_table for s in group] == [[0, 2], [0, 3], [0, 1]]
    finish_all(sched, *group)


def test_n3_prompt_one_past_a_block_boundary_needs_no_copy():
    # P = 9: the fork point is 8 tokens, two full blocks; token 8 starts a new block for each.
    sched = make_scheduler()
    bm = sched.block_manager
    group = add(sched, 9, n=3)
    assert batch(step(sched)) == [(group[0], 8, False)]
    out = step(sched)
    assert out.blocks_to_copy == []
    assert [s.block_table for s in group] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert [bm.ref_count(i) for i in range(5)] == [3, 3, 1, 1, 1]
    finish_all(sched, *group)


def test_n2_with_a_one_token_prompt_runs_independent_sequences():
    sched = make_scheduler()
    a, b = add(sched, 1, n=2)
    assert list(sched.waiting) == [a, b]
    assert batch(step(sched)) == [(a, 1, True), (b, 1, True)]
    assert (a.block_table, b.block_table) == ([0], [1])
    finish_all(sched, a, b)


def test_an_unforked_parent_reserves_its_childrens_seq_slots():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    parent, child = add(sched, 10, n=2)
    other, = add(sched, 1)
    assert batch(step(sched)) == [(parent, 4, False)]  # other waits: the child's slot is taken
    assert batch(step(sched)) == [(parent, 4, False)]
    assert batch(step(sched)) == [(parent, 1, False)]
    assert sched.running == [parent, child]
    assert batch(step(sched)) == [(parent, 1, True), (child, 1, True)]
    sched.finish(child)
    assert batch(step(sched)) == [(parent, 1, True), (other, 1, True)]
    finish_all(sched, parent, other)


def test_a_parent_preempted_before_its_fork_keeps_its_children_waiting():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8)
    a, = add(sched, 4)
    parent, child = add(sched, 10, n=2)
    assert batch(step(sched)) == [(a, 4, True), (parent, 4, False)]
    # a takes block 2 for token 4; the parent needs 2 more blocks for tokens 4..8, 1 is free.
    out = step(sched)
    assert batch(out) == [(a, 1, True)] and preempted(out) == [parent]
    assert parent.num_computed_tokens == 0 and parent.block_table == []
    assert list(sched.waiting) == [parent] and sched.num_waiting == 2
    assert child.status is SequenceStatus.WAITING
    assert sched.block_manager.free_block_ids == [3, 1]
    sched.finish(a)
    assert batch(step(sched)) == [(parent, 8, False)]
    assert batch(step(sched)) == [(parent, 1, False)]
    assert sched.running == [parent, child] and child.block_table == parent.block_table == [3, 1, 2]
    assert child.num_computed_tokens == 9
    # Token 9 lands in block 2, shared and holding token 8: the parent copies it into block 0.
    out = step(sched)
    assert batch(out) == [(parent, 1, True), (child, 1, True)] and out.blocks_to_copy == [(2, 0)]
    assert (parent.block_table, child.block_table) == ([3, 1, 0], [3, 1, 2])
    finish_all(sched, parent, child)


def test_a_preempted_child_recomputes_alone():
    sched = make_scheduler(num_blocks=3)
    bm = sched.block_manager
    parent, child = add(sched, 6, n=2)
    step(sched)  # the parent computes 5 tokens in blocks [0, 1]; the child forks
    out = step(sched)  # the parent copies block 1; the child then owns it alone
    assert out.blocks_to_copy == [(1, 2)]
    assert (parent.block_table, child.block_table) == ([0, 2], [0, 1])
    step(sched)
    step(sched)  # 8 tokens each; token 8 needs a new block for each, none is free
    out = step(sched)
    assert preempted(out) == [child] and batch(out) == [(parent, 1, True)]
    assert parent.block_table == [0, 2, 1] and bm.ref_count(0) == 1
    assert child.num_computed_tokens == 0 and child.output_token_ids == [SAMPLED] * 3
    sched.finish(parent)
    out = step(sched)
    assert batch(out) == [(child, 9, True)]
    assert child.block_table == [1, 2, 0] and child.output_token_ids == [SAMPLED] * 4
    finish_all(sched, child)


# ---- randomized workloads with a fake model -----------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_every_invariant_and_drain(seed, enable_prefix_caching):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(3, 24)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24),
                           max_model_len=rng.randint(2, 2 * num_blocks * block_size),
                           enable_prefix_caching=enable_prefix_caching)
    num_outputs: dict[int, int] = {}  # seq_id -> tokens to generate before the engine finishes it
    requests: list[list[Sequence]] = []
    refused, aborted = set(), set()
    for _ in range(600):
        if len(requests) < 25 and rng.random() < 0.3:
            group = add(sched, rng.randint(1, 12), n=rng.choice([1, 1, 2, 3]))
            requests.append(group)
            for seq in group:
                num_outputs[seq.seq_id] = rng.randint(1, 8)
        if requests and rng.random() < 0.03:
            aborted.update(id(s) for s in sched.abort_request(rng.choice(requests)[0].request_id))
        out = step(sched)
        refused.update(id(s) for s, _ in rejected(out))
        finish_done(sched, out, num_outputs)
        if len(requests) == 25 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "workload did not drain"
    assert_drained(sched)
    for seq in (s for group in requests for s in group):
        assert seq.is_finished
        if id(seq) not in refused and id(seq) not in aborted:
            assert seq.output_token_ids == [SAMPLED] * num_outputs[seq.seq_id]
