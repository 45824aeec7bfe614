"""Scheduler with request priorities (engine.priority): queue order, who is preempted, ties,
chunked prefill, prefix caching, and randomized workloads with mixed priorities. With one priority
throughout the scheduler is FCFS: test_scheduler*.py pin that.

Every test ends with every sequence finished and every block back in the pool.
"""

from __future__ import annotations


import pytest

from llmplatform.engine.sequence import SequenceStatus
from tests.unit.scheduler_helpers import (SAMPLED, add, batch, deferred, finish_all, make_scheduler,
                                          preempted, random_workload, step)


def test_the_waiting_queue_is_in_priority_order_and_fcfs_among_equals():
    sched = make_scheduler()
    a, = add(sched, 2, priority=1)
    b, = add(sched, 2, priority=0)
    c, = add(sched, 2, priority=1)
    d, = add(sched, 2, priority=0)
    e, = add(sched, 2, priority=2)
    f, = add(sched, 2, priority=-3)  # any integer: negative ones run before the default 0
    assert list(sched.waiting) == [f, b, d, a, c, e]
    # max_num_seqs=4: the four best go first, in that order.
    assert batch(step(sched)) == [(f, 2, True), (b, 2, True), (d, 2, True), (a, 2, True)]
    assert sched.running == [f, b, d, a] and list(sched.waiting) == [c, e]
    finish_all(sched, a, b, c, d, e, f)


def test_a_better_priority_request_behind_many_others_is_admitted_first():
    sched = make_scheduler(max_num_batched_tokens=8)
    lows = [add(sched, 4, priority=1)[0] for _ in range(5)]
    high, = add(sched, 4, priority=0)
    assert batch(step(sched)) == [(high, 4, True), (lows[0], 4, True)]
    assert list(sched.waiting) == lows[1:]
    finish_all(sched, high, *lows)


def test_the_worst_priority_is_preempted_even_when_admitted_first():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    bm = sched.block_manager
    low, = add(sched, 4, priority=5)
    assert batch(step(sched)) == [(low, 4, True)]
    h1, = add(sched, 4)
    h2, = add(sched, 4)
    out = step(sched)
    assert batch(out) == [(low, 1, True), (h1, 4, True), (h2, 4, True)]
    assert sched.running == [h1, h2, low]  # priority order, not admission order
    assert (low.block_table, h1.block_table, h2.block_table, bm.free_block_ids) == ([0, 1], [2], [3], [])
    # h1's token 4 needs a block: FCFS would preempt h2 (the newest), priority preempts low.
    out = step(sched)
    assert preempted(out) == [low] and batch(out) == [(h1, 1, True), (h2, 1, True)]
    assert (h1.block_table, h2.block_table) == ([2, 1], [3, 0])
    assert low.status is SequenceStatus.WAITING and low.output_token_ids == [SAMPLED, SAMPLED]
    sched.finish(h1)
    # low recomputes its prompt and kept output (6 tokens) behind h2's decode.
    assert batch(step(sched)) == [(h2, 1, True), (low, 6, True)]
    finish_all(sched, h2, low)


def test_among_equal_priorities_the_newest_admitted_is_preempted():
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=32)
    high, = add(sched, 4, priority=0)
    a, = add(sched, 4, priority=1)
    b, = add(sched, 4, priority=1)
    assert batch(step(sched)) == [(high, 4, True), (a, 4, True), (b, 4, True)]
    # Two free blocks for three sequences growing into their second block: b, the newest of the
    # worst priority, gives way; a, admitted before it, keeps running.
    out = step(sched)
    assert preempted(out) == [b] and batch(out) == [(high, 1, True), (a, 1, True)]
    assert list(sched.waiting) == [b]
    finish_all(sched, high, a, b)


def test_a_preempted_sequence_goes_to_the_front_of_its_priority_only():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=32)
    a, = add(sched, 4, priority=1)
    b, = add(sched, 4, priority=1)
    assert batch(step(sched)) == [(a, 4, True), (b, 4, True)]
    high, = add(sched, 4, priority=0)
    late, = add(sched, 4, priority=1)
    # a's token 4 takes the last free block; b's then preempts b, which queues ahead of `late`
    # (its priority, arrived later) but behind `high`.
    out = step(sched)
    assert preempted(out) == [b] and batch(out) == [(a, 1, True)]
    assert list(sched.waiting) == [high, b, late]
    finish_all(sched, a, b, high, late)


def test_a_better_priority_arrival_never_preempts_a_running_sequence():
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=32)
    low, = add(sched, 8, priority=9)
    assert batch(step(sched)) == [(low, 8, True)]
    high, = add(sched, 4, priority=0)
    low2, = add(sched, 2, priority=9)
    # low's token 8 takes the last free block; high waits for blocks, and nothing skips it.
    for _ in range(3):
        out = step(sched)
        assert batch(out) == [(low, 1, True)] and preempted(out) == []
    assert list(sched.waiting) == [high, low2]
    sched.finish(low)
    assert batch(step(sched)) == [(high, 4, True), (low2, 2, True)]
    finish_all(sched, high, low2)


def test_a_freed_seq_slot_goes_to_the_best_priority_waiting():
    sched = make_scheduler(max_num_seqs=1)
    first, = add(sched, 2, priority=3)
    assert batch(step(sched)) == [(first, 2, True)]
    early, = add(sched, 2, priority=3)
    high, = add(sched, 2, priority=1)
    assert batch(step(sched)) == [(first, 1, True)]  # the slot is taken: no preemption
    sched.finish(first)
    assert batch(step(sched)) == [(high, 2, True)]
    finish_all(sched, high, early)


def test_a_better_priority_prefill_goes_before_worse_priority_decodes():
    sched = make_scheduler(max_num_batched_tokens=4)
    low, = add(sched, 2, priority=1)
    assert batch(step(sched)) == [(low, 2, True)]
    high, = add(sched, 10, priority=0)
    # Admitted in the budget low's decode leaves, then served first: its chunks take the budget
    # until its prompt is computed (same-priority decodes would go first, as in FCFS).
    assert batch(step(sched)) == [(low, 1, True), (high, 3, False)]
    assert sched.running == [high, low]
    assert batch(step(sched)) == [(high, 4, False)]
    assert batch(step(sched)) == [(high, 3, True), (low, 1, True)]
    assert batch(step(sched)) == [(high, 1, True), (low, 1, True)]
    finish_all(sched, high, low)


def test_n2_children_keep_their_request_priority():
    sched = make_scheduler(max_num_batched_tokens=32)
    low, = add(sched, 4, priority=1)
    parent, child = add(sched, 6, n=2, priority=0)
    assert batch(step(sched)) == [(parent, 5, False), (low, 4, True)]
    assert batch(step(sched)) == [(parent, 1, True), (child, 1, True), (low, 1, True)]
    assert sched.running == [parent, child, low]
    finish_all(sched, parent, child, low)


def test_a_better_priority_request_takes_its_cached_prefix_ahead_of_others():
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=32)
    prompt = list(range(100, 110))  # two full blocks and a partial one
    first, = add(sched, prompt, priority=1)
    assert batch(step(sched)) == [(first, 10, True)]
    sched.finish(first)
    other, = add(sched, list(range(200, 210)), priority=1)
    high, = add(sched, prompt, priority=0)
    # high goes first and computes only what its cached 8 tokens leave.
    assert batch(step(sched)) == [(high, 2, True), (other, 10, True)]
    finish_all(sched, high, other)


def test_a_better_priority_sequence_deferred_for_a_prefix_in_flight_keeps_its_place():
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=8)
    prompt = list(range(100, 112))  # three full blocks
    sharer, = add(sched, prompt, priority=1)
    assert batch(step(sched)) == [(sharer, 8, False)]
    high, = add(sched, prompt + [1, 2], priority=0)
    other, = add(sched, 2, priority=1)
    # sharer computes prompt block 2 this step: high waits for it (a step), and the worse
    # priority behind it takes the budget meanwhile.
    out = step(sched)
    assert batch(out) == [(sharer, 4, True), (other, 2, True)] and deferred(out) == [(high, 1)]
    assert list(sched.waiting) == [high]
    # Then high is admitted with all three blocks cached, and served first from the next step.
    assert batch(step(sched)) == [(sharer, 1, True), (other, 1, True), (high, 2, True)]
    assert sched.running == [high, sharer, other]
    assert batch(step(sched)) == [(high, 1, True), (sharer, 1, True), (other, 1, True)]
    finish_all(sched, sharer, high, other)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_random_prioritized_workloads_keep_every_invariant_and_drain(seed, enable_prefix_caching):
    def victims_are_the_worst(sched, out, live) -> None:
        victims = preempted(out)
        if victims:  # each victim was the worst running priority when it went
            assert max((s.priority for s in sched.running), default=-1) <= min(s.priority for s in victims)

    random_workload(seed, enable_prefix_caching, [0, 1, 2], check=victims_are_the_worst)
