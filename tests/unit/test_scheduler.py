"""Scheduler: exact batches, preemption, rejection, abort and n > 1 forking, driven by a fake model.

Every test ends with every sequence finished and every block back in the pool.
"""

from __future__ import annotations

import itertools
import random

import pytest

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import SchedulerConfig
from llmplatform.engine.outputs import ModelOutput, SchedulerOutput
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence, SequenceStatus
from llmplatform.llm.sampling import SamplingParams

SAMPLED = 7  # the fake model always samples this token
_request_ids = itertools.count()


def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=64, enable_prefix_caching=False) -> Scheduler:
    # Every request here has the same prompt prefix: these tests pin batches and block ids without
    # the prefix cache (tests/unit/test_prefix_caching.py covers the scheduler with it).
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    return Scheduler(config, BlockManager(num_blocks=num_blocks, block_size=block_size,
                                          enable_prefix_caching=enable_prefix_caching))


def add(sched: Scheduler, num_prompt_tokens: int, n: int = 1) -> list[Sequence]:
    request_id = f"req-{next(_request_ids)}"
    prompt = list(range(1000, 1000 + num_prompt_tokens))
    seqs = [Sequence(request_id, list(prompt), SamplingParams(), index=i) for i in range(n)]
    sched.add_request(seqs)
    return seqs


def check(sched: Scheduler, *, after_update: bool) -> None:
    bm = sched.block_manager
    bm.check_invariants(sched.running)
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert 0 <= seq.num_computed_tokens <= seq.num_tokens
        if after_update:  # the table covers exactly the computed tokens, and there is work left
            assert len(seq.block_table) == bm.num_blocks_for(seq.num_computed_tokens)
            assert seq.num_uncomputed_tokens >= 1
    if after_update:
        # Decodes first: only the last running sequence may have an unfinished prefill (a parent
        # before its fork point has one token left when its children fork).
        for seq in sched.running[:-1]:
            assert seq.num_uncomputed_tokens == 1, f"a prefill under way before {sched.running[-1]}"
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        assert seq.num_computed_tokens == 0


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model that samples SAMPLED for each sequence that samples."""
    out = sched.schedule()
    check(sched, after_update=False)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        end = item.seq.num_computed_tokens + item.num_new_tokens
        assert end <= item.seq.num_tokens and item.samples == (end == item.seq.num_tokens)
        assert len(item.seq.block_table) >= sched.block_manager.num_blocks_for(end)
    samplers = [item.seq for item in out.scheduled if item.samples]
    sched.update(out, ModelOutput(seq_ids=[s.seq_id for s in samplers], token_ids=[SAMPLED] * len(samplers),
                                  logprobs=[None] * len(samplers)))
    check(sched, after_update=True)
    return out


def batch(out: SchedulerOutput) -> list[tuple[Sequence, int, bool]]:
    return [(s.seq, s.num_new_tokens, s.samples) for s in out.scheduled]


def finish_all(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.finish(seq)
    assert_drained(sched)


def assert_drained(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished() and sched.num_running == 0 and sched.num_waiting == 0
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


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
    assert out.preempted == [] and out.blocks_to_copy == [] and out.rejected == []
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
    assert out.preempted == [c]
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
    assert batch(out) == [(a, 1, True)] and out.preempted == [b]
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
    assert batch(out) == [(a, 1, True)] and out.preempted == [b]
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
    assert out.preempted == [child, parent]
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
    assert out.rejected == [(long, "sequence has 33 tokens (prompt 33 + output 0), more than max_model_len=32")]
    assert long.status is SequenceStatus.FINISHED and long.block_table == []
    assert batch(out) == [(ok, 3, True)]
    assert sched.get_request_seqs(long.request_id) == []
    finish_all(sched, ok)


def test_a_prompt_larger_than_the_kv_pool_is_rejected():
    sched = make_scheduler(num_blocks=4, max_model_len=64)
    big, = add(sched, 17)
    out = step(sched)
    assert out.rejected == [(big, "sequence has 17 tokens, more than the KV cache holds "
                                  "(4 blocks of 4 = 16 tokens)")]
    assert out.scheduled == []
    assert_drained(sched)


def test_a_running_sequence_that_outgrows_the_pool_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, = add(sched, 7)
    assert batch(step(sched)) == [(a, 7, True)]
    assert batch(step(sched)) == [(a, 1, True)]  # 9 tokens now: the pool holds 8
    out = step(sched)
    assert out.rejected == [(a, "sequence has 9 tokens, more than the KV cache holds (2 blocks of 4 = 8 tokens)")]
    assert out.scheduled == [] and out.preempted == []
    assert_drained(sched)


def test_a_request_wanting_more_sequences_than_max_num_seqs_is_rejected_whole():
    sched = make_scheduler(max_num_seqs=2)
    group = add(sched, 5, n=3)
    out = step(sched)
    reason = "request asks for 3 parallel sequences, more than max_num_seqs=2"
    assert out.rejected == [(s, reason) for s in group]
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
    assert batch(out) == [(a, 1, True)] and out.preempted == [parent]
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
    assert out.preempted == [child] and batch(out) == [(parent, 1, True)]
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
    rejected, aborted = set(), set()
    for _ in range(600):
        if len(requests) < 25 and rng.random() < 0.3:
            group = add(sched, rng.randint(1, 12), n=rng.choice([1, 1, 2, 3]))
            requests.append(group)
            for seq in group:
                num_outputs[seq.seq_id] = rng.randint(1, 8)
        if requests and rng.random() < 0.03:
            aborted.update(id(s) for s in sched.abort_request(rng.choice(requests)[0].request_id))
        out = step(sched)
        rejected.update(id(s) for s, _ in out.rejected)
        for item in out.scheduled:
            seq = item.seq
            if item.samples and len(seq.output_token_ids) >= num_outputs[seq.seq_id]:
                sched.finish(seq)
        if len(requests) == 25 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "workload did not drain"
    assert_drained(sched)
    for seq in (s for group in requests for s in group):
        assert seq.is_finished
        if id(seq) not in rejected and id(seq) not in aborted:
            assert seq.output_token_ids == [SAMPLED] * num_outputs[seq.seq_id]
