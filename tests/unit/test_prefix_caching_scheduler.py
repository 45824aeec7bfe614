"""The scheduler with prefix caching: admission after the cached prefix, the budget a hit leaves,
forks and preemption over cached blocks, and random workloads checked against a fake KV cache
(the hash chain and the block manager: test_prefix_caching.py).
"""

from __future__ import annotations

import random

import pytest

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.outputs import ModelOutput, SchedulerOutput
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence, SequenceStatus
from llmplatform.sampling.params import SamplingParams
from tests.unit import scheduler_helpers
from tests.unit.scheduler_helpers import (SAMPLED, add, assert_drained, batch, finish_all,
                                          finish_done, preempted, seq_of, step)

PROMPT = list(range(100, 110))  # 10 tokens: with block_size 4, two full blocks and a partial one


def make_scheduler(**kwargs) -> Scheduler:
    return scheduler_helpers.make_scheduler(enable_prefix_caching=True, **kwargs)


def test_admission_starts_after_the_cached_prefix():
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    assert batch(step(sched)) == [(a, 10, True)]
    b, = add(sched, PROMPT[:8] + [1, 2, 3, 4, 5])
    out = step(sched)
    # b's first 8 tokens are cached (blocks 0, 1): it computes only its last 5.
    assert batch(out) == [(a, 1, True), (b, 5, True)]
    assert b.block_table == [0, 1, 3, 4] and out.blocks_to_copy == []
    stats = sched.block_manager.prefix_cache_stats
    assert (stats.num_queries, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 23, 8)
    finish_all(sched, a, b)


def test_a_cache_hit_leaves_budget_for_others():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, = add(sched, PROMPT[:8] + [1])
    assert [batch(step(sched)) for _ in range(2)] == [[(a, 8, False)], [(a, 1, True)]]
    b, = add(sched, PROMPT[:8] + [2])
    c, = add(sched, PROMPT[:8] + [3])
    # Each needs only its last token: both fit beside a's decode in a budget of 8.
    assert batch(step(sched)) == [(a, 1, True), (b, 1, True), (c, 1, True)]
    finish_all(sched, a, b, c)


def test_the_whole_prompt_cached_recomputes_its_last_full_block():
    sched = make_scheduler()
    a, = add(sched, PROMPT[:8])
    step(sched)
    sched.finish(a)
    b, = add(sched, PROMPT[:8])
    assert batch(step(sched)) == [(b, 4, True)]
    assert b.block_table[0] == 0 and b.output_token_ids == [SAMPLED]
    finish_all(sched, b)


def test_prompt_logprobs_requests_skip_the_lookup():
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    step(sched)
    b, = add(sched, PROMPT, params=SamplingParams(prompt_logprobs=1))
    assert batch(step(sched)) == [(a, 1, True), (b, 10, True)]
    assert sched.block_manager.prefix_cache_stats.num_queries == 1  # only a looked
    finish_all(sched, a, b)


def test_n3_with_a_cached_prompt_forks_after_the_hit():
    sched = make_scheduler()
    bm = sched.block_manager
    a, = add(sched, PROMPT)
    step(sched)
    sched.finish(a)
    assert bm.free_block_ids == list(range(3, 16)) + [2, 1, 0]
    parent, child1, child2 = group = add(sched, PROMPT, n=3)
    # The fork point is P - 1 = 9 tokens: the hit covers 8, the parent computes token 8 alone.
    out = step(sched)
    assert batch(out) == [(parent, 1, False)]
    assert [s.block_table for s in group] == [[0, 1, 3]] * 3
    assert [bm.ref_count(i) for i in range(4)] == [3, 3, 0, 3]
    # Then each computes token 9 into the shared block 3 (holding token 8): two copy it.
    out = step(sched)
    assert batch(out) == [(parent, 1, True), (child1, 1, True), (child2, 1, True)]
    assert out.blocks_to_copy == [(3, 4), (3, 5)]
    assert [s.block_table for s in group] == [[0, 1, 4], [0, 1, 5], [0, 1, 3]]
    finish_all(sched, *group)


def test_a_preempted_sequence_finds_its_own_blocks_cached_when_readmitted():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=32)
    bm = sched.block_manager
    a, = add(sched, [1, 2, 3, 4])
    b, = add(sched, [11, 12, 13, 14, 15, 16])
    assert batch(step(sched)) == [(a, 4, True), (b, 6, True)]
    assert (a.block_table, b.block_table, bm.free_block_ids) == ([0], [1, 2], [3])
    step(sched)  # a takes block 3 for token 4; b's token 6 fits block 2
    step(sched)  # b's block 2 fills up (tokens 4..7) and is cached
    assert bm.block_hash(2) is not None and bm.free_block_ids == []
    out = step(sched)  # b's token 8 needs a block, none is free: b, the newest, preempts itself
    assert preempted(out) == [b] and batch(out) == [(a, 1, True)]
    assert bm.free_block_ids == [2, 1] and bm.num_cached_blocks == 3  # b's blocks still cached
    sched.finish(a)
    assert bm.free_block_ids == [2, 1, 3, 0]
    # b has 9 tokens (6 + 3 generated): 8 come from its own cached blocks, token 8 is computed.
    out = step(sched)
    assert batch(out) == [(b, 1, True)]
    assert b.block_table == [1, 2, 3] and b.output_token_ids == [SAMPLED] * 4
    stats = bm.prefix_cache_stats
    assert (stats.num_queries, stats.num_queried_tokens, stats.num_hit_tokens) == (3, 4 + 6 + 9, 8)
    finish_all(sched, b)


def test_reset_makes_the_next_request_miss():
    sched = make_scheduler()
    a, = add(sched, PROMPT)
    step(sched)
    sched.finish(a)
    sched.block_manager.reset_prefix_cache()
    b, = add(sched, PROMPT)
    assert batch(step(sched)) == [(b, 10, True)]
    finish_all(sched, b)


# ---- random workloads against a fake KV cache ---------------------------------------------------


class FakeKV:
    """Records, per KV slot, the token prefix whose K/V it holds (K/V at position p depends on
    tokens 0..p), and checks each scheduled chunk reads exactly its own sequence's prefixes."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[int, tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput) -> None:
        size = self.bm.block_size
        for src, dst in out.blocks_to_copy:
            for offset in range(size):
                if src * size + offset in self.slots:
                    self.slots[dst * size + offset] = self.slots[src * size + offset]
        for item in out.scheduled:
            seq = seq_of(item)
            tokens = tuple(seq.all_token_ids())
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            for position in range(start, end):
                self.slots[self.bm.slot(seq, position)] = tokens[:position + 1]
        for item in out.scheduled:  # attention reads every position up to the chunk's end
            seq = seq_of(item)
            tokens = tuple(seq.all_token_ids())
            for position in range(seq.num_computed_tokens + item.num_new_tokens):
                assert self.slots.get(self.bm.slot(seq, position)) == tokens[:position + 1], \
                    f"seq {seq.seq_id} reads wrong KV at position {position}"


@pytest.mark.parametrize("seed", range(30))
def test_random_workloads_read_only_their_own_kv(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(6, 30)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(4, 24),
                           max_model_len=num_blocks * block_size)
    kv = FakeKV(sched.block_manager)
    # Prompts from a few shared stems and a small alphabet: hits, partial hits and misses.
    stems = [[rng.randint(0, 3) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    num_outputs: dict[int, int] = {}
    requests: list[list[Sequence]] = []
    for _ in range(500):
        if len(requests) < 25 and rng.random() < 0.3:
            prompt = rng.choice(stems) + [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
            params = SamplingParams(prompt_logprobs=1) if rng.random() < 0.1 else None
            group = add(sched, prompt, n=rng.choice([1, 1, 2, 3]), params=params)
            requests.append(group)
            for seq in group:
                num_outputs[seq.seq_id] = rng.randint(1, 8)
        if requests and rng.random() < 0.03:
            sched.abort_request(rng.choice(requests)[0].request_id)
        out = sched.schedule()
        kv.run(out)
        samplers = [seq_of(item) for item in out.scheduled if item.samples]
        # Sampled tokens differ per sequence, so siblings and look-alikes diverge.
        sched.update(out, ModelOutput(seq_ids=[s.seq_id for s in samplers],
                                      token_ids=[rng.randint(0, 3) for _ in samplers],
                                      logprobs=[None] * len(samplers)))
        sched.block_manager.check_invariants(sched.running)
        for seq in sched.running[:-1]:
            assert seq.num_uncomputed_tokens == 1  # decodes first
        finish_done(sched, out, num_outputs)
        if len(requests) == 25 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "workload did not drain"
    assert_drained(sched)
    assert all(s.status is SequenceStatus.FINISHED for group in requests for s in group)
    assert sched.block_manager.prefix_cache_stats.num_hit_tokens > 0  # the workload did exercise the cache
