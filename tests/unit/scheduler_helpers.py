"""The scheduler tests' fake model and invariant checks (test_scheduler*.py).

``step`` plays the engine: schedule, check every invariant, feed a fake model's output back,
check again.
"""

from __future__ import annotations

import itertools

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import SchedulerConfig
from llmplatform.engine.outputs import ModelOutput, SchedulerOutput
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence, SequenceStatus
from llmplatform.sampling.params import SamplingParams

SAMPLED = 7  # the fake model always samples this token
_request_ids = itertools.count()


def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=64, enable_prefix_caching=False) -> Scheduler:
    # Every request here has the same prompt prefix: these tests pin batches and block ids without
    # the prefix cache (test_prefix_caching_scheduler.py covers the scheduler with it).
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    return Scheduler(config, BlockManager(num_blocks=num_blocks, block_size=block_size,
                                          enable_prefix_caching=enable_prefix_caching))


def add(sched: Scheduler, prompt: int | list[int], n: int = 1,
        params: SamplingParams | None = None) -> list[Sequence]:
    """A request of ``n`` sequences: ``prompt`` is its token ids, or how many (1000, 1001, ...)."""
    request_id = f"req-{next(_request_ids)}"
    if isinstance(prompt, int):
        prompt = list(range(1000, 1000 + prompt))
    seqs = [Sequence(request_id, list(prompt), params or SamplingParams(), index=i) for i in range(n)]
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


def finish_done(sched: Scheduler, out: SchedulerOutput, num_outputs: dict[int, int]) -> None:
    """Finish each sequence of `out` that has sampled its `num_outputs[seq_id]` tokens (what the
    engine does on a length stop), as randomized workloads do after every step."""
    for item in out.scheduled:
        if item.samples and len(item.seq.output_token_ids) >= num_outputs[item.seq.seq_id]:
            sched.finish(item.seq)


def finish_all(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.finish(seq)
    assert_drained(sched)


def assert_drained(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished() and sched.num_running == 0 and sched.num_waiting == 0
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
