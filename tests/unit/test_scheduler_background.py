"""Background requests (priority >= BACKGROUND_PRIORITY, the gateway's batch lines) in the
scheduler (engine.priority, "Background requests"): they take only the idle tokens of a step while
foreground work is unfinished, the whole budget when it is not, and give way to a foreground
request that needs their seq slot or blocks. Randomized workloads with a background band keep every
invariant and drain.

Every test ends with every sequence finished and every block back in the pool.
"""

from __future__ import annotations

import random

import pytest

from llmplatform.engine.priority import is_background
from llmplatform.engine.sequence import SequenceStatus
from llmplatform.protocol.worker import BACKGROUND_PRIORITY, MAX_PRIORITY
from tests.unit.scheduler_helpers import (SAMPLED, add, batch, finish_all, make_scheduler, preempted,
                                          random_workload, rejected, step)

BG = BACKGROUND_PRIORITY


def test_the_background_band_starts_at_its_priority():
    sched = make_scheduler()
    below, at, worst = add(sched, 2, priority=BG - 1)[0], add(sched, 2, priority=BG)[0], \
        add(sched, 2, priority=MAX_PRIORITY)[0]
    assert [is_background(s) for s in (below, at, worst)] == [False, True, True]
    finish_all(sched, below, at, worst)


def test_alone_background_work_takes_up_to_its_step_limit():
    sched = make_scheduler(max_num_batched_tokens=16, background_max_step_tokens=8)
    a, = add(sched, 6, priority=BG)
    b, = add(sched, 6, priority=BG)
    assert batch(step(sched)) == [(a, 6, True), (b, 2, False)]
    assert batch(step(sched)) == [(a, 1, True), (b, 4, True)]
    assert batch(step(sched)) == [(a, 1, True), (b, 1, True)]
    finish_all(sched, a, b)


def test_beside_foreground_work_background_rows_get_their_share_only():
    sched = make_scheduler(max_num_seqs=6, max_num_batched_tokens=16, background_tokens=2)
    bgs = [add(sched, 2, priority=BG)[0] for _ in range(4)]
    assert batch(step(sched)) == [(s, 2, True) for s in bgs]
    f1, = add(sched, 2)
    f2, = add(sched, 2)
    # Busy from now on: the running background decodes, served first, get the share (two
    # tokens); the foreground prompts are admitted after them.
    assert batch(step(sched)) == [(bgs[0], 1, True), (bgs[1], 1, True), (f1, 2, True), (f2, 2, True)]
    assert batch(step(sched)) == [(f1, 1, True), (f2, 1, True), (bgs[0], 1, True), (bgs[1], 1, True)]
    sched.finish(f1)
    assert batch(step(sched)) == [(f2, 1, True), (bgs[0], 1, True), (bgs[1], 1, True)]
    sched.finish(f2)  # idle again: every background row
    assert batch(step(sched)) == [(s, 1, True) for s in bgs]
    finish_all(sched, *bgs)


def test_a_background_prompt_is_prefilled_in_small_chunks_beside_foreground_work():
    sched = make_scheduler(max_num_batched_tokens=16, background_tokens=3)
    fg, = add(sched, 2)
    bg, = add(sched, 10, priority=BG)
    assert batch(step(sched)) == [(fg, 2, True), (bg, 3, False)]
    assert batch(step(sched)) == [(fg, 1, True), (bg, 3, False)]
    assert batch(step(sched)) == [(fg, 1, True), (bg, 3, False)]
    sched.finish(fg)
    assert batch(step(sched)) == [(bg, 1, True)]
    finish_all(sched, bg)


def test_no_share_means_no_background_work_while_the_foreground_runs():
    sched = make_scheduler(max_num_batched_tokens=16, background_tokens=0)
    fg, = add(sched, 3)
    bg, = add(sched, 3, priority=BG)
    assert batch(step(sched)) == [(fg, 3, True)]
    assert batch(step(sched)) == [(fg, 1, True)]
    assert bg.status is SequenceStatus.WAITING
    sched.finish(fg)
    assert batch(step(sched)) == [(bg, 3, True)]
    finish_all(sched, bg)


def test_a_foreground_request_takes_the_seq_slot_of_the_newest_background_one():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16, background_tokens=16)
    bgs = [add(sched, 2, priority=BG)[0] for _ in range(3)]
    assert batch(step(sched)) == [(s, 2, True) for s in bgs]
    fg, = add(sched, 2)
    out = step(sched)
    assert preempted(out) == [bgs[2]] and bgs[2].status is SequenceStatus.WAITING
    assert batch(out) == [(bgs[0], 1, True), (bgs[1], 1, True), (fg, 2, True)]
    assert bgs[2].output_token_ids == [SAMPLED]  # its output is kept: it recomputes later
    sched.finish(fg)
    assert batch(step(sched)) == [(bgs[0], 1, True), (bgs[1], 1, True), (bgs[2], 3, True)]
    finish_all(sched, *bgs)


def test_a_foreground_request_takes_the_blocks_of_background_ones():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                           background_tokens=16)
    bg1, = add(sched, 8, priority=BG)
    bg2, = add(sched, 7, priority=BG + 1)  # the worse of the two: it goes first
    assert batch(step(sched)) == [(bg1, 8, True), (bg2, 7, True)]
    assert sched.block_manager.num_free_blocks == 0
    fg, = add(sched, 4)
    out = step(sched)
    assert preempted(out) == [bg2]
    assert batch(out) == [(bg1, 1, True), (fg, 4, True)]
    finish_all(sched, bg1, bg2, fg)


def test_a_foreground_request_that_cannot_fit_anyway_preempts_nothing():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32, background_tokens=16)
    fg1, = add(sched, 11)  # its three blocks hold its decodes for a while
    bg, = add(sched, 3, priority=BG)
    assert batch(step(sched)) == [(fg1, 11, True), (bg, 3, True)]
    fg2, = add(sched, 9)  # three blocks: only bg's one could be freed
    out = step(sched)
    assert preempted(out) == [] and fg2.status is SequenceStatus.WAITING
    finish_all(sched, fg1, bg, fg2)


def test_background_work_never_preempts_foreground_work():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16, background_tokens=16)
    f1, f2 = add(sched, 2)[0], add(sched, 2)[0]
    step(sched)
    bg, = add(sched, 2, priority=BG)
    for _ in range(3):
        out = step(sched)
        assert preempted(out) == [] and batch(out) == [(f1, 1, True), (f2, 1, True)]
    finish_all(sched, f1, f2, bg)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_with_background_work_keep_every_invariant_and_drain(
        seed, enable_prefix_caching):
    def background_takes_its_share_only(sched, out, live) -> None:
        busy = any(not is_background(s) for s in live.values())
        # While foreground work is unfinished, background work gets its share at most.
        background = sum(s.num_new_tokens for s in out.scheduled if is_background(live[s.seq_id]))
        if busy and not any(not is_background(s) for s, _ in rejected(out)):
            assert background <= sched.background.allowance
        for victim in preempted(out):  # never a foreground sequence while a background one runs
            assert is_background(victim) or not any(is_background(s) for s in sched.running)

    random_workload(seed, enable_prefix_caching, [0, 1, BG, BG, BG + 1],
                    background_tokens=random.Random(-seed).randint(0, 8),
                    check=background_takes_its_share_only, num_steps=800)
