"""Scheduler: exact batches, chunked prefill, preemption, rejection and abort, driven by a fake
model (n > 1 forking and randomized workloads: test_scheduler_groups.py).

Every test ends with every sequence finished and every block back in the pool.
"""

from __future__ import annotations

from llmplatform.engine.outputs import ModelOutput
from llmplatform.engine.sequence import SequenceStatus
from tests.unit.scheduler_helpers import (SAMPLED, add, assert_drained, batch, finish_all,
                                          make_scheduler, preempted, rejected, step)


# ---- batches ---------------------------------------------------------------------------------


def test_chunked_prefills_and_decodes_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, = add(sched, 5)
    b, = add(sched, 6)
    c, = add(sched, 3)
    # A's whole prompt, then B's first 3 tokens fill the budget; C waits.
    out = step(sched)
    assert batch(out) == [(a, 5, True), (b, 3, False)]
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    assert a.output_token_ids == [SAMPLED] and b.num_computed_tokens == 3
    assert list(sched.waiting) == [c]
    # A decodes, B finishes its prefill, C's prompt fits the 4 tokens left.
    out = step(sched)
    assert batch(out) == [(a, 1, True), (b, 3, True), (c, 3, True)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4])
    # Decode batch.
    out = step(sched)
    assert batch(out) == [(a, 1, True), (b, 1, True), (c, 1, True)]
    assert [s.num_tokens for s in (a, b, c)] == [8, 8, 5]
    assert [s.num_computed_tokens for s in (a, b, c)] == [7, 7, 4]
    assert preempted(out) == [] and out.blocks_to_copy == [] and rejected(out) == []
    finish_all(sched, a, b, c)
    assert sched.block_manager.free_block_ids == list(range(5, 16)) + [1, 0, 3, 2, 4]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks():
    sched = make_scheduler(max_num_batched_tokens=4)
    a, = add(sched, 10)
    assert [batch(step(sched)) for _ in range(4)] == [
        [(a, 4, False)], [(a, 4, False)], [(a, 2, True)], [(a, 1, True)]]
    assert a.block_table == [0, 1, 2] and a.output_token_ids == [SAMPLED, SAMPLED]
    finish_all(sched, a)


def test_fcfs_never_skips_the_head_of_the_queue():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    a, = add(sched, 12)  # 3 blocks
    b, = add(sched, 8)   # 2 blocks: does not fit beside a
    c, = add(sched, 2)   # 1 block: would fit, but b is ahead
    out = step(sched)
    assert batch(out) == [(a, 12, True)]
    assert list(sched.waiting) == [b, c] and sched.num_waiting == 2
    sched.finish(a)
    assert batch(step(sched)) == [(b, 8, True), (c, 2, True)]
    assert (b.block_table, c.block_table) == ([3, 2], [1])
    finish_all(sched, b, c)


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    a, = add(sched, 2)
    b, = add(sched, 2)
    c, = add(sched, 2)
    assert batch(step(sched)) == [(a, 2, True), (b, 2, True)]
    assert batch(step(sched)) == [(a, 1, True), (b, 1, True)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    sched.finish(a)
    assert batch(step(sched)) == [(b, 1, True), (c, 2, True)]
    finish_all(sched, b, c)


# ---- chunked prefill: decodes first ---------------------------------------------------------------


def test_a_long_prompt_fills_the_budget_the_running_decodes_leave():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, = add(sched, 3)
    assert batch(step(sched)) == [(a, 3, True)]
    long, = add(sched, 40)
    # Every step: a's decode first, then a chunk of the long prompt in the 7 tokens left.
    batches = [batch(step(sched)) for _ in range(7)]
    assert batches == [[(a, 1, True), (long, 7, False)]] * 5 + [
        [(a, 1, True), (long, 5, True)], [(a, 1, True), (long, 1, True)]]
    assert a.output_token_ids == [SAMPLED] * 8 and long.output_token_ids == [SAMPLED] * 2
    finish_all(sched, a, long)


def test_several_decodes_go_before_a_long_prompt_admitted_earlier():
    sched = make_scheduler(max_num_batched_tokens=8, num_blocks=32, max_model_len=128)
    long, = add(sched, 30)
    assert batch(step(sched)) == [(long, 8, False)]
    a, = add(sched, 2)
    b, = add(sched, 2)
    # The long prompt keeps the whole budget while it prefills: a and b wait (FCFS admission).
    assert batch(step(sched)) == [(long, 8, False)]
    assert batch(step(sched)) == [(long, 8, False)]
    # Its last chunk leaves room: a and b are admitted behind it, and decode before any chunk.
    assert batch(step(sched)) == [(long, 6, True), (a, 2, True)]
    assert batch(step(sched)) == [(long, 1, True), (a, 1, True), (b, 2, True)]
    finish_all(sched, long, a, b)


def test_children_forked_while_a_long_prompt_prefills_are_not_starved():
    sched = make_scheduler(max_num_batched_tokens=8, num_blocks=32, max_model_len=128)
    parent, child = add(sched, 5, n=2)
    long, = add(sched, 30)
    # The parent stops at its fork point (4 tokens); the long prompt takes the other 4.
    assert batch(step(sched)) == [(parent, 4, False), (long, 4, False)]
    # The child is placed right after its parent, so it decodes before the long prompt's chunk.
    assert sched.running == [parent, child, long]
    for _ in range(4):
        assert batch(step(sched)) == [(parent, 1, True), (child, 1, True), (long, 6, False)]
    assert batch(step(sched)) == [(parent, 1, True), (child, 1, True), (long, 2, True)]
    finish_all(sched, parent, child, long)


# ---- preemption ------------------------------------------------------------------------------


def test_preempts_the_most_recently_admitted_and_recomputes_it_later():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    bm = sched.block_manager
    a, = add(sched, 4)
    b, = add(sched, 4)
    c, = add(sched, 4)
    assert batch(step(sched)) == [(a, 4, True), (b, 4, True), (c, 4, True)]
    assert (a.block_table, b.block_table, c.block_table, bm.free_block_ids) == ([0], [1], [2], [3])
    # Token 4 of each needs a new block: a takes the last free one, b takes c's.
    out = step(sched)
    assert batch(out) == [(a, 1, True), (b, 1, True)]
    assert preempted(out) == [c]
    assert (a.block_table, b.block_table, c.block_table, bm.free_block_ids) == ([0, 3], [1, 2], [], [])
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.output_token_ids == [SAMPLED] and c.num_preemptions == 1
    assert list(sched.waiting) == [c]
    # No room: c waits at the head.
    assert batch(step(sched)) == [(a, 1, True), (b, 1, True)]
    sched.finish(a)
    assert bm.free_block_ids == [3, 0]
    # c recomputes prompt + its kept output token (5 tokens) and samples its second token.
    out = step(sched)
    assert batch(out) == [(b, 1, True), (c, 5, True)]
    assert c.block_table == [3, 0] and c.num_computed_tokens == 5
    assert c.output_token_ids == [SAMPLED, SAMPLED]
    assert batch(step(sched)) == [(b, 1, True), (c, 1, True)]
    finish_all(sched, b, c)


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3)
    bm = sched.block_manager
    a, = add(sched, 6)
    b, = add(sched, 4)
    step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    out = step(sched)  # a's token 6 fits block 1; b's token 4 needs a block there is none of
    assert batch(out) == [(a, 1, True)] and preempted(out) == [b]
    assert bm.free_block_ids == [2] and list(sched.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    # b's recompute (5 tokens) needs 2 blocks; 1 is free.
    assert batch(step(sched)) == [(a, 1, True)]
    sched.finish(a)
    assert bm.free_block_ids == [2, 1, 0]
    assert batch(step(sched)) == [(b, 5, True)]
    assert b.block_table == [2, 1] and b.output_token_ids == [SAMPLED, SAMPLED]
    finish_all(sched, b)


def test_a_step_that_preempted_admits_nothing():
    sched = make_scheduler(num_blocks=4, block_size=1, max_num_batched_tokens=2)
    bm = sched.block_manager
    a, = add(sched, 1)
    b, = add(sched, 2)
    assert batch(step(sched)) == [(a, 1, True), (b, 1, False)]
    assert batch(step(sched)) == [(a, 1, True), (b, 1, True)]
    assert bm.free_block_ids == []
    out = step(sched)
    assert batch(out) == [(a, 1, True)] and preempted(out) == [b]
    # A 1-token chunk of b would fit block 1 and the budget left, but the pool is under pressure:
    # readmitting b now would only have it preempted again.
    assert bm.free_block_ids == [1] and list(sched.waiting) == [b]
    assert batch(step(sched)) == [(a, 1, True)]  # a takes block 1; b still cannot fit
    sched.finish(a)
    assert batch(step(sched)) == [(b, 2, False)]
    assert batch(step(sched)) == [(b, 1, True)]
    assert b.output_token_ids == [SAMPLED, SAMPLED] and b.num_computed_tokens == 3
    finish_all(sched, b)


def test_preempting_a_sharer_frees_nothing_so_preemption_goes_on():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    bm = sched.block_manager
    a, = add(sched, 4)
    parent, child = add(sched, 9, n=2)
    assert batch(step(sched)) == [(a, 4, True), (parent, 8, False)]
    assert sched.running == [a, parent, child] and child.block_table == [1, 2]
    # a takes the last free block. The parent's token 8 needs a new block: preempting the child
    # only drops its references, so the parent preempts itself too.
    out = step(sched)
    assert batch(out) == [(a, 1, True)]
    assert preempted(out) == [child, parent]
    assert list(sched.waiting) == [parent, child]  # admission order kept
    assert a.block_table == [0, 3] and bm.free_block_ids == [2, 1]
    assert batch(step(sched)) == [(a, 1, True)]  # the parent needs 3 blocks: nobody skips it
    sched.finish(a)
    # Forked once, the two recompute as independent sequences: nothing is shared any more.
    assert batch(step(sched)) == [(parent, 9, True)]
    assert parent.block_table == [2, 1, 3] and list(sched.waiting) == [child]
    sched.finish(parent)
    assert batch(step(sched)) == [(child, 9, True)]
    finish_all(sched, child)


# ---- rejection --------------------------------------------------------------------------------


def test_a_prompt_longer_than_max_model_len_is_rejected_and_others_proceed():
    sched = make_scheduler(max_model_len=32)
    long, = add(sched, 33)
    ok, = add(sched, 3)
    out = step(sched)
    assert rejected(out) == [(long, "sequence has 33 tokens (prompt 33 + output 0), more than max_model_len=32")]
    assert long.status is SequenceStatus.FINISHED and long.block_table == []
    assert batch(out) == [(ok, 3, True)]
    assert sched.get_request_seqs(long.request_id) == []
    finish_all(sched, ok)


def test_a_prompt_larger_than_the_kv_pool_is_rejected():
    sched = make_scheduler(num_blocks=4, max_model_len=64)
    big, = add(sched, 17)
    out = step(sched)
    assert rejected(out) == [(big, "sequence has 17 tokens, more than the KV cache holds "
                                  "(4 blocks of 4 = 16 tokens)")]
    assert out.scheduled == []
    assert_drained(sched)


def test_a_running_sequence_that_outgrows_the_pool_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, = add(sched, 7)
    assert batch(step(sched)) == [(a, 7, True)]
    assert batch(step(sched)) == [(a, 1, True)]  # 9 tokens now: the pool holds 8
    out = step(sched)
    assert rejected(out) == [(a, "sequence has 9 tokens, more than the KV cache holds (2 blocks of 4 = 8 tokens)")]
    assert out.scheduled == [] and preempted(out) == []
    assert_drained(sched)


def test_a_request_wanting_more_sequences_than_max_num_seqs_is_rejected_whole():
    sched = make_scheduler(max_num_seqs=2)
    group = add(sched, 5, n=3)
    out = step(sched)
    reason = "request asks for 3 parallel sequences, more than max_num_seqs=2"
    assert rejected(out) == [(s, reason) for s in group]
    assert all(s.is_finished for s in group)
    assert_drained(sched)


# ---- abort -----------------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    a, = add(sched, 8)
    b, = add(sched, 12)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.abort_request(b.request_id) == [b]
    assert b.is_finished and sched.num_waiting == 0
    assert sched.abort_request(a.request_id) == [a]
    assert a.is_finished and a.block_table == []
    assert sched.abort_request(a.request_id) == [] and sched.abort_request("nope") == []
    assert_drained(sched)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = make_scheduler()
    a, = add(sched, 5)
    out = sched.schedule()
    sched.abort_request(a.request_id)
    sched.update(out, ModelOutput(seq_ids=[a.seq_id], token_ids=[SAMPLED], logprobs=[None]))
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    assert_drained(sched)


def test_abort_a_group_before_its_fork():
    sched = make_scheduler(max_num_batched_tokens=4)
    group = add(sched, 10, n=3)
    assert batch(step(sched)) == [(group[0], 4, False)]
    assert sched.num_running == 1 and sched.num_waiting == 2
    assert sched.abort_request(group[0].request_id) == group
    assert all(s.is_finished for s in group)
    assert_drained(sched)


def test_abort_a_forked_group():
    sched = make_scheduler()
    group = add(sched, 6, n=3)
    step(sched)
    assert sched.num_running == 3 and sched.block_manager.ref_count(0) == 3
    assert sched.abort_request(group[0].request_id) == group
    assert_drained(sched)
