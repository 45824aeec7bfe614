"""The scheduler tests' fake model and invariant checks (test_scheduler*.py).

``step`` plays the engine: schedule, check every invariant, feed a fake model's output back,
check again. The scheduler's output names sequences by id; ``SEQS`` maps the ids back to the
sequences the tests made (``seq_of``, ``batch``, ``preempted``, ``deferred``, ``rejected``), and
``RunnerMirror`` plays the model runner's bookkeeping: built from the output's new and cached
records alone, its block tables and computed tokens must be the scheduler's.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence as Seq

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import SchedulerConfig
from llmplatform.engine.outputs import ModelOutput, ScheduledChunk, SchedulerOutput
from llmplatform.engine.priority import is_background
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence, SequenceStatus
from llmplatform.sampling.params import SamplingParams

SAMPLED = 7  # the fake model always samples this token
_request_ids = itertools.count()
# Every sequence a test scheduler was given, by id (sequence ids are unique in the process).
SEQS: dict[int, Sequence] = {}


class RecordingScheduler(Scheduler):
    """A scheduler that registers its sequences in ``SEQS`` and checks each output against a
    mirror of the runner's bookkeeping (``RunnerMirror``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mirror = RunnerMirror()

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.mirror.apply(out)
        return out

    def add_request(self, seqs: list[Sequence]) -> None:
        SEQS.update((seq.seq_id, seq) for seq in seqs)
        super().add_request(seqs)


def seq_of(item: ScheduledChunk | int) -> Sequence:
    return SEQS[item if isinstance(item, int) else item.seq_id]


def preempted(out: SchedulerOutput) -> list[Sequence]:
    return [SEQS[seq_id] for seq_id in out.preempted]


def deferred(out: SchedulerOutput) -> list[tuple[Sequence, int]]:
    return [(SEQS[seq_id], num_blocks) for seq_id, num_blocks in out.deferred]


def rejected(out: SchedulerOutput) -> list[tuple[Sequence, str]]:
    return [(SEQS[seq_id], reason) for seq_id, reason in out.rejected]


class RunnerMirror:
    """What a model runner knows of each sequence, from the scheduler's records only."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for seq_id in out.finished_seq_ids:
            del self.tables[seq_id], self.computed[seq_id]
        for new in out.new_seqs:
            seq = SEQS[new.seq_id]
            assert new.prompt_token_ids == tuple(seq.prompt_token_ids)
            assert new.output_token_ids == tuple(seq.output_token_ids)
            self.tables[new.seq_id] = list(new.block_ids)
            self.computed[new.seq_id] = new.num_computed_tokens
        for cached in out.cached_seqs:
            del self.tables[cached.seq_id][cached.block_ids_from:]
            self.tables[cached.seq_id].extend(cached.new_block_ids)
            self.computed[cached.seq_id] = cached.num_computed_tokens
        assert {r.seq_id for r in out.new_seqs} | {r.seq_id for r in out.cached_seqs} \
            == {item.seq_id for item in out.scheduled}, "every chunk has exactly one record"
        for item in out.scheduled:
            seq = seq_of(item)
            assert self.tables[item.seq_id] == seq.block_table, f"seq {item.seq_id}'s table"
            assert self.computed[item.seq_id] == seq.num_computed_tokens




def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=64, enable_prefix_caching=False, background_tokens=None,
                   background_max_step_tokens=SchedulerConfig.background_max_step_tokens,
                   background_grace_s=0.0) -> Scheduler:
    """``background_tokens``: what background sequences get of a step while foreground ones are
    unfinished, fixed (engine.background measures it from step durations otherwise); no grace
    after foreground work by default (it goes by the clock)."""
    # Every request here has the same prompt prefix: these tests pin batches and block ids without
    # the prefix cache (test_prefix_caching_scheduler.py covers the scheduler with it).
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len,
                             background_max_step_tokens=background_max_step_tokens,
                             background_grace_s=background_grace_s)
    sched = RecordingScheduler(config, BlockManager(num_blocks=num_blocks, block_size=block_size,
                                                    enable_prefix_caching=enable_prefix_caching))
    if background_tokens is not None:
        sched.background.fix(background_tokens)
    return sched


def add(sched: Scheduler, prompt: int | list[int], n: int = 1,
        params: SamplingParams | None = None, priority: int = 0) -> list[Sequence]:
    """A request of ``n`` sequences: ``prompt`` is its token ids, or how many (1000, 1001, ...)."""
    request_id = f"req-{next(_request_ids)}"
    if isinstance(prompt, int):
        prompt = list(range(1000, 1000 + prompt))
    seqs = [Sequence(request_id, list(prompt), params or SamplingParams(), index=i, priority=priority)
            for i in range(n)]
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
        # Decodes first: at most one running sequence has an unfinished prefill (a parent before
        # its fork point has one token left when its children fork), and only worse priorities
        # follow it (with one priority throughout, it is the last). Background sequences, held to
        # the idle tokens of a step while foreground ones run, may have one more of their own.
        for band in (False, True):
            running = [s for s in sched.running if is_background(s) is band]
            under_way = [i for i, seq in enumerate(running) if seq.num_uncomputed_tokens > 1]
            assert len(under_way) <= 1, f"prefills under way: {under_way}"
            for seq in running[under_way[0] + 1:] if under_way else ():
                assert seq.priority > running[under_way[0]].priority, "a prefill before a decode"
    # Both queues in priority order (engine.priority).
    for queue in (sched.running, list(sched.waiting)):
        assert [s.priority for s in queue] == sorted(s.priority for s in queue)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        assert seq.num_computed_tokens == 0


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model that samples SAMPLED for each sequence that samples."""
    out = sched.schedule()
    check(sched, after_update=False)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        seq = seq_of(item)
        end = seq.num_computed_tokens + item.num_new_tokens
        assert end <= seq.num_tokens and item.samples == (end == seq.num_tokens)
        assert len(seq.block_table) >= sched.block_manager.num_blocks_for(end)
    samplers = [seq_of(item) for item in out.scheduled if item.samples]
    sched.update(out, ModelOutput(seq_ids=[s.seq_id for s in samplers], token_ids=[SAMPLED] * len(samplers),
                                  logprobs=[None] * len(samplers)))
    check(sched, after_update=True)
    return out


def batch(out: SchedulerOutput) -> list[tuple[Sequence, int, bool]]:
    return [(seq_of(s), s.num_new_tokens, s.samples) for s in out.scheduled]


def finish_done(sched: Scheduler, out: SchedulerOutput, num_outputs: dict[int, int]) -> None:
    """Finish each sequence of `out` that has sampled its `num_outputs[seq_id]` tokens (what the
    engine does on a length stop), as randomized workloads do after every step."""
    for item in out.scheduled:
        if item.samples and len(seq_of(item).output_token_ids) >= num_outputs[item.seq_id]:
            sched.finish(seq_of(item))


def finish_all(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.finish(seq)
    assert_drained(sched)


def assert_drained(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert not sched.has_unfinished() and sched.num_running == 0 and sched.num_waiting == 0
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def random_workload(seed: int, enable_prefix_caching: bool, priorities: Seq[int], *,
                    background_tokens: int | None = None,
                    check: Callable[[Scheduler, SchedulerOutput, dict[int, Sequence]], None] | None = None,
                    num_steps: int = 600) -> None:
    """A seeded random workload (random pool, limits and requests of the given priorities, some
    sharing a prefix, some with n=2) stepped until it drains, every invariant checked each step
    (and ``check(sched, out, live_before)`` with the unfinished sequences as the step began);
    every sequence not rejected ends with exactly its outputs."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(3, 20)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24),
                           max_model_len=rng.randint(2, 2 * num_blocks * block_size),
                           enable_prefix_caching=enable_prefix_caching,
                           background_tokens=background_tokens)
    num_outputs: dict[int, int] = {}
    requests: list[list[Sequence]] = []
    refused = set()
    for _ in range(num_steps):
        if len(requests) < 25 and rng.random() < 0.3:
            prompt = rng.choice([rng.randint(1, 12), [5] * rng.randint(4, 12)])  # some share
            group = add(sched, prompt, n=rng.choice([1, 1, 2]), priority=rng.choice(priorities))
            requests.append(group)
            for seq in group:
                num_outputs[seq.seq_id] = rng.randint(1, 8)
        live = dict(sched._live)
        out = step(sched)
        if check is not None:
            check(sched, out, live)
        refused.update(id(s) for s, _ in rejected(out))
        finish_done(sched, out, num_outputs)
        if len(requests) == 25 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "workload did not drain"
    assert_drained(sched)
    for seq in (s for group in requests for s in group):
        if id(seq) not in refused:
            assert seq.output_token_ids == [SAMPLED] * num_outputs[seq.seq_id]
