"""The scheduler defers a waiting sequence whose prefix another sequence is computing this step
(engine.scheduler, "Prefixes in flight"): exact batches, who waits and for how long, what releases
a waiter, and random workloads against a fake KV cache with many look-alike prompts.
"""

from __future__ import annotations

import random

import pytest

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import SchedulerConfig
from llmplatform.engine.outputs import ModelOutput
from llmplatform.engine.pooling import PoolingMode, PoolingParams
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence, SequenceStatus
from llmplatform.sampling.params import SamplingParams
from tests.unit.scheduler_helpers import (SAMPLED, RecordingScheduler, add, assert_drained, batch,
                                          check, deferred, finish_all, finish_done, preempted,
                                          seq_of, step)
from tests.unit.test_prefix_caching_scheduler import FakeKV

PROMPT = list(range(100, 110))  # 10 tokens: with block_size 4, two full blocks and a partial one


def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                   max_model_len=64, min_in_flight_prefix_blocks=1) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len,
                             min_in_flight_prefix_blocks=min_in_flight_prefix_blocks)
    return RecordingScheduler(config, BlockManager(num_blocks=num_blocks, block_size=block_size))


def hits(sched: Scheduler) -> int:
    return sched.block_manager.prefix_cache_stats.num_hit_tokens


def test_the_same_prompt_twice_in_one_step_is_computed_once():
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    out = step(sched)
    # a computes the prompt; b would need a's two full blocks, which this very step computes.
    assert batch(out) == [(a, 10, True)] and deferred(out) == [(b, 2)]
    assert sched.waiting[0] is b and b.status is SequenceStatus.WAITING
    assert sched.num_waiting == 1 and sched.num_running == 1
    out = step(sched)
    # Now cached: b starts after them and computes only its last 2 tokens.
    assert batch(out) == [(a, 1, True), (b, 2, True)] and deferred(out) == []
    assert b.block_table[:2] == a.block_table[:2] and hits(sched) == 8
    assert a.output_token_ids == [SAMPLED] * 2 and b.output_token_ids == [SAMPLED]
    finish_all(sched, a, b)


def test_with_the_threshold_at_0_both_compute_the_prefix():
    sched = make_scheduler(min_in_flight_prefix_blocks=0)
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    out = step(sched)
    assert batch(out) == [(a, 10, True), (b, 10, True)] and deferred(out) == []
    assert hits(sched) == 0
    finish_all(sched, a, b)


def test_fewer_blocks_in_flight_than_the_threshold_do_not_defer():
    sched = make_scheduler(min_in_flight_prefix_blocks=3)
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)  # shares 2 full blocks: fewer than 3
    assert batch(step(sched)) == [(a, 10, True), (b, 10, True)]
    finish_all(sched, a, b)


def test_an_unrelated_request_behind_a_deferred_one_is_not_held_up():
    sched = make_scheduler(max_num_batched_tokens=32)
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    c, = add(sched, [1, 2, 3, 4, 5, 6])
    d, = add(sched, PROMPT[:4] + [9, 9, 9, 9, 9])  # shares a's first block only
    out = step(sched)
    # b and d wait in their places; c, behind b, runs in the first step.
    assert batch(out) == [(a, 10, True), (c, 6, True)]
    assert deferred(out) == [(b, 2), (d, 1)] and list(sched.waiting) == [b, d]
    out = step(sched)
    assert batch(out) == [(a, 1, True), (c, 1, True), (b, 2, True), (d, 5, True)]
    assert hits(sched) == 8 + 4
    finish_all(sched, a, b, c, d)


def test_a_deferred_sequence_keeps_its_place_when_others_do_not_fit():
    sched = make_scheduler(max_num_seqs=2)
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    c, = add(sched, [1, 2, 3])
    d, = add(sched, [4, 5, 6])
    out = step(sched)
    # b waits for a's blocks; c takes the second slot; d does not fit and stops admission.
    assert batch(out) == [(a, 10, True), (c, 3, True)] and deferred(out) == [(b, 2)]
    assert list(sched.waiting) == [b, d]
    sched.finish(c)
    # b is ahead of d again: FCFS among those not waiting for a prefix.
    assert batch(step(sched)) == [(a, 1, True), (b, 2, True)]
    finish_all(sched, a, b, d)


def test_a_waiter_is_admitted_once_the_shared_blocks_are_computed_under_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=6)
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT[:8] + [1, 2, 3])
    # Step 1: a's first chunk takes the whole budget; b is not considered yet.
    out = step(sched)
    assert batch(out) == [(a, 6, False)] and deferred(out) == []
    # Step 2: a's last 4 tokens compute block 1, which b needs (block 0 is cached already).
    out = step(sched)
    assert batch(out) == [(a, 4, True)] and deferred(out) == [(b, 1)]
    # Step 3: b finds both shared blocks cached, though a went on (here: to decode).
    out = step(sched)
    assert batch(out) == [(a, 1, True), (b, 3, True)]
    assert hits(sched) == 8
    finish_all(sched, a, b)


def test_a_deferral_is_reported_once_per_wait():
    sched = make_scheduler(max_num_batched_tokens=32)
    a, = add(sched, PROMPT)
    c, = add(sched, PROMPT[:8] + [1] * 8)
    b, = add(sched, PROMPT[:8] + [1] * 8 + [2])
    out = step(sched)
    assert batch(out) == [(a, 10, True)] and deferred(out) == [(c, 2), (b, 2)]
    out = step(sched)
    # c starts after a's blocks and computes blocks 2 and 3, which b needs next: b waits on.
    assert batch(out) == [(a, 1, True), (c, 8, True)] and deferred(out) == []
    assert b in sched.waiting
    out = step(sched)
    assert batch(out) == [(a, 1, True), (c, 1, True), (b, 1, True)]
    assert hits(sched) == 8 + 16
    finish_all(sched, a, b, c)


def test_aborting_the_computing_request_mid_step_releases_the_waiter():
    """An abort (or a failure) between scheduling and update: a's blocks are freed without being
    cached, and b, released, computes the prefix itself."""
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    out = sched.schedule()
    assert deferred(out) == [(b, 2)]
    sched.abort_request(a.request_id)
    sched.update(out, ModelOutput(seq_ids=[a.seq_id], token_ids=[SAMPLED], logprobs=[None]))
    check(sched, after_update=True)
    assert sched.block_manager.num_in_flight_hashes == 0
    assert batch(step(sched)) == [(b, 10, True)] and hits(sched) == 0
    finish_all(sched, b)


def test_aborting_a_waiter_forgets_it():
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    assert deferred(step(sched)) == [(b, 2)]
    sched.abort_request(b.request_id)
    assert b.is_finished and not sched.waiting and not sched._deferred_seq_ids
    finish_all(sched, a)


def test_preempted_sharers_are_readmitted_first_and_their_waiter_follows():
    """Both sharers are preempted by an older sequence; readmitted, the first recomputes the blocks
    evicted meanwhile while the second waits for them, and neither waits on a waiting one."""
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=16, max_num_seqs=3)
    bm = sched.block_manager
    old, = add(sched, [50, 51, 52, 53])
    step(sched)
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT)
    out = step(sched)
    assert batch(out) == [(old, 1, True), (a, 10, True)] and deferred(out) == [(b, 2)]
    assert batch(step(sched)) == [(old, 1, True), (a, 1, True), (b, 2, True)]
    assert b.block_table[:2] == a.block_table[:2] == [2, 3]
    step(sched)
    # old outgrows the pool: the newest running sequences are preempted, b then a.
    assert preempted(step(sched)) == [b] and preempted(step(sched)) == [a]
    assert list(sched.waiting) == [a, b] and bm.num_in_flight_hashes == 0
    for _ in range(8):
        assert batch(step(sched)) == [(old, 1, True)]  # old's new blocks evict a's cached ones
    assert bm.find_cached_prefix(a, a.num_tokens) == [2]
    sched.finish(old)
    out = step(sched)
    # a, at the front, starts after its one cached block; b would need the next, which a is
    # computing: it waits for it (instead of computing it too), not for a as a whole.
    assert batch(out) == [(a, 10, True)] and deferred(out) == [(b, 1)]
    out = step(sched)
    assert batch(out) == [(a, 1, True), (b, 4, True)]
    assert b.block_table[:2] == a.block_table[:2]
    finish_all(sched, a, b)


def test_prompt_logprobs_and_mean_pooling_never_wait():
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    b, = add(sched, PROMPT, params=SamplingParams(prompt_logprobs=1))
    mean = Sequence("mean", list(PROMPT), SamplingParams(max_tokens=1),
                    pooling=PoolingParams(mode=PoolingMode.MEAN))
    last = Sequence("last", list(PROMPT), SamplingParams(max_tokens=1),
                    pooling=PoolingParams(mode=PoolingMode.LAST))
    sched.add_request([mean])
    sched.add_request([last])
    out = sched.schedule()  # (the helper's step() expects every finished prompt to sample)
    # Neither b nor the mean pool may use the cache, so they compute; last-token pooling waits.
    assert batch(out) == [(a, 10, True), (b, 10, True), (mean, 10, False)]
    assert deferred(out) == [(last, 2)]
    sched.update(out, ModelOutput(seq_ids=[a.seq_id, b.seq_id], token_ids=[SAMPLED] * 2,
                                  logprobs=[None] * 2))
    sched.finish(mean)  # the engine finishes a pooling sequence in the step of its last token
    out = sched.schedule()
    assert batch(out) == [(a, 1, True), (b, 1, True), (last, 2, False)]
    finish_all(sched, a, b, last)


def test_n2_requests_with_one_prompt_share_it_and_still_fork():
    sched = make_scheduler()
    bm = sched.block_manager
    group1 = add(sched, PROMPT, n=2)
    group2 = add(sched, PROMPT, n=2)
    out = step(sched)
    # Parent 1 prefills up to its fork point (9 tokens); parent 2 waits for its 2 full blocks.
    assert batch(out) == [(group1[0], 9, False)] and deferred(out) == [(group2[0], 2)]
    out = step(sched)
    # Group 1 forks and samples; parent 2 starts after the cached blocks and stops at its fork.
    assert batch(out) == [(group1[0], 1, True), (group1[1], 1, True), (group2[0], 1, False)]
    out = step(sched)
    assert [(s.seq_id, n) for s, n, _ in batch(out)][-2:] == [(group2[0].seq_id, 1), (group2[1].seq_id, 1)]
    assert all(s.block_table[:2] == group1[0].block_table[:2] for s in group2)
    assert all(len(s.output_token_ids) >= 1 for s in group1 + group2)
    bm.check_invariants(sched.running)
    finish_all(sched, *group1, *group2)


def test_children_released_by_their_parent_share_their_prefix_through_the_same_path():
    sched = make_scheduler(max_num_batched_tokens=4)
    parent, child1, child2 = add(sched, PROMPT, n=3)
    assert batch(step(sched)) == [(parent, 4, False)]  # block 0, up to the fork point at 9
    sched.finish(parent)  # e.g. failed: its children now run on their own
    assert list(sched.waiting) == [child1, child2]
    out = step(sched)
    # child1 takes cached block 0 and computes block 1 with the budget; child2 is not reached.
    assert batch(out) == [(child1, 4, False)]
    out = step(sched)
    # child1's last 2 tokens; child2 starts after the 2 cached blocks.
    assert batch(out) == [(child1, 2, True), (child2, 2, True)]
    assert hits(sched) == 4 + 8
    finish_all(sched, child1, child2)


def test_the_in_flight_notes_live_for_one_step():
    sched = make_scheduler()
    bm = sched.block_manager
    a, = add(sched, PROMPT)
    out = sched.schedule()
    assert bm.num_in_flight_hashes == 2
    bm.check_invariants(sched.running)
    sched.update(out, ModelOutput(seq_ids=[a.seq_id], token_ids=[SAMPLED], logprobs=[None]))
    assert bm.num_in_flight_hashes == 0
    b, = add(sched, PROMPT[:4] + [1, 2, 3, 4])
    sched.schedule()  # a's decode and b's prompt (block 1 in flight: block 0 is a's, cached)
    assert bm.num_in_flight_hashes == 1
    sched.finish(b)  # freed mid-step
    assert bm.num_in_flight_hashes == 0
    bm.check_invariants(sched.running)
    finish_all(sched, a)


def run_look_alike_workload(seed: int) -> int:
    """Many requests on a few prompts, arriving in bursts, with aborts: checks that every chunk
    reads its own prefix's KV, the in-flight notes never outlive a step and the workload drains.
    Returns how many deferrals it saw."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(8, 30)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.randint(6, 24),
                           max_model_len=num_blocks * block_size,
                           min_in_flight_prefix_blocks=rng.choice([1, 1, 2]))
    bm = sched.block_manager
    kv = FakeKV(bm)
    stems = [[rng.randint(0, 50) for _ in range(rng.randint(4, 12))] for _ in range(2)]
    num_outputs: dict[int, int] = {}
    requests: list[list[Sequence]] = []
    num_deferred = 0
    for _ in range(600):
        if len(requests) < 30 and rng.random() < 0.25:
            for _ in range(rng.randint(1, 3)):  # a burst on one stem
                prompt = rng.choice(stems) + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
                params = SamplingParams(prompt_logprobs=1) if rng.random() < 0.05 else None
                group = add(sched, prompt, n=rng.choice([1, 1, 1, 2]), params=params)
                requests.append(group)
                for seq in group:
                    num_outputs[seq.seq_id] = rng.randint(1, 6)
        if requests and rng.random() < 0.03:
            sched.abort_request(rng.choice(requests)[0].request_id)
        out = sched.schedule()
        num_deferred += len(deferred(out))
        for seq, num_blocks_in_flight in deferred(out):
            assert seq.status is SequenceStatus.WAITING and num_blocks_in_flight >= 1
        kv.run(out)
        samplers = [seq_of(item) for item in out.scheduled if item.samples]
        sched.update(out, ModelOutput(seq_ids=[s.seq_id for s in samplers],
                                      token_ids=[rng.randint(0, 3) for _ in samplers],
                                      logprobs=[None] * len(samplers)))
        assert bm.num_in_flight_hashes == 0
        bm.check_invariants(sched.running)
        finish_done(sched, out, num_outputs)
        if len(requests) >= 30 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "workload did not drain"
    assert_drained(sched)
    assert all(s.status is SequenceStatus.FINISHED for group in requests for s in group)
    assert not sched._deferred_seq_ids
    return num_deferred


@pytest.mark.parametrize("seed", range(30))
def test_random_look_alike_workloads_read_only_their_own_kv(seed):
    run_look_alike_workload(seed)


def test_random_look_alike_workloads_do_defer():
    assert sum(run_look_alike_workload(seed) for seed in range(10)) > 0
