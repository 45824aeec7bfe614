"""Speculative decoding's pure parts (engine.speculative): the n-gram proposer, the scheduler's
KV rollback after verification (exact block counts), the config, and the acceptance rule's
output distribution (chi-square against the target distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.config import (EngineConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                       SchedulerConfig, SpeculativeConfig)
from llmplatform.engine.outputs import AcceptedTokens, ModelOutput
from llmplatform.engine.scheduler import Scheduler
from llmplatform.engine.sequence import Sequence
from llmplatform.engine.speculative.proposer import NgramProposer, ProposalRoom, ngram_lookup
from llmplatform.engine.speculative.rejection import _greedy_run, _sampled_run
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.sampler import SamplingRow, make_generator


# ---- the proposer ------------------------------------------------------------------------------

def lookup(tokens, min_n=1, max_n=3, k=4):
    return ngram_lookup(np.array(tokens, dtype=np.int64), min_n, max_n, k)


def test_lookup_proposes_what_followed_the_longest_match():
    # Suffix [1, 2, 3] occurred at 0 (followed by 9, 9) and [2, 3] at 5 (followed by 5): the
    # longer match wins.
    assert lookup([1, 2, 3, 9, 9, 2, 3, 5, 1, 2, 3]) == [9, 9, 2, 3]


def test_lookup_prefers_the_most_recent_occurrence_and_caps_k():
    assert lookup([7, 1, 7, 2, 7], max_n=1, k=2) == [2, 7]
    assert lookup([7, 1, 7, 2, 7], max_n=1, k=1) == [2]


def test_lookup_stops_at_the_history_end_and_needs_min_n():
    assert lookup([4, 5, 6, 4, 5], min_n=2, k=5) == [6, 4, 5]
    assert lookup([4, 5, 6, 1, 5], min_n=2) == []  # only a 1-gram matches
    assert lookup([4, 5, 6, 1, 5], min_n=1) == [6, 1, 5]
    assert lookup([3]) == [] and lookup([3, 3], k=3) == [3]


def _decoding(prompt, output, max_tokens=50, grammar=None):
    seq = Sequence(request_id=str(id(prompt)), prompt_token_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens, temperature=0), grammar=grammar)
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


BM = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)


def ngram(config: SpeculativeConfig, **room) -> NgramProposer:
    return NgramProposer(config, ProposalRoom(config, **room))


def test_proposer_caps_by_max_tokens_budget_and_batch_size():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=2)
    proposer = ngram(config, max_num_batched_tokens=64, max_model_len=100)
    a = _decoding([1, 2, 3, 4, 5, 6, 1, 2], [3])
    b = _decoding([1, 2, 3, 4, 5, 6, 1, 2], [3], max_tokens=3)  # 2 outputs left: K <= 1
    prefill = _decoding([1, 2, 3, 1, 2], [])  # no output yet: not decoding
    prefill.num_computed_tokens = 0
    assert proposer.propose([a, b, prefill], BM) == 4
    assert a.spec_token_ids == [4, 5, 6] and b.spec_token_ids == [4] and prefill.spec_token_ids == []
    # Three decoding sequences: over disable_by_batch_size, every proposal cleared.
    c = _decoding([1, 2, 1, 2], [1])
    assert proposer.propose([a, b, c], BM) == 0
    assert a.spec_token_ids == b.spec_token_ids == c.spec_token_ids == []
    # A budget of 4 tokens for two decodes leaves 2 proposals in all; so does a limit of 4 rows.
    tight = ngram(config, max_num_batched_tokens=4, max_model_len=100)
    assert tight.propose([a, c], BM) == 2 and a.spec_token_ids == [4, 5] and c.spec_token_ids == []
    few_rows = ngram(config, max_num_batched_tokens=64, max_model_len=100, max_step_rows=4)
    assert few_rows.propose([a, c], BM) == 2 and a.spec_token_ids == [4, 5]
    # Slots for proposals only from blocks no decode needs: 10 tokens in 3 blocks of 4 (9
    # computed) and 3 proposals need a 4th block; with none free, 2 proposals (12 tokens) fit.
    d = _decoding([1, 2, 3, 4, 5, 6, 1, 2], [3, 4])
    d.block_table = [0, 1, 2]
    one_free = BlockManager(num_blocks=1, block_size=4, enable_prefix_caching=False)
    assert proposer.propose([d], one_free) == 3 and d.spec_token_ids == [5, 6, 1]
    one_free.allocate_slots(_decoding([9], []), 1)  # now none is free
    assert proposer.propose([d], one_free) == 2 and d.spec_token_ids == [5, 6]
    # A constrained sequence never speculates.
    g = _decoding([1, 2, 1, 2], [1], grammar=object())
    assert proposer.propose([g], BM) == 0 and g.spec_token_ids == []


# ---- the scheduler's rollback ------------------------------------------------------------------

def _run_step(scheduler, accept: dict[int, int], token=11):
    """One step of a fake model that accepts ``accept[seq_id]`` proposals of each sequence."""
    out = scheduler.schedule()
    ids, accepted = [], {}
    for item in out.scheduled:
        if item.samples:
            ids.append(item.seq_id)
            if item.spec_token_ids:
                n = accept.get(item.seq_id, 0)
                accepted[item.seq_id] = AcceptedTokens(list(item.spec_token_ids[:n]), [None] * n,
                                                       len(item.spec_token_ids))
    scheduler.update(out, ModelOutput(ids, [token] * len(ids), [None] * len(ids), accepted=accepted))
    return out


@pytest.mark.parametrize("caching", [False, True])
def test_rejected_slots_are_rolled_back_to_the_non_speculative_blocks(caching):
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=caching)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=64), bm)
    seq = Sequence(request_id="r", prompt_token_ids=[1, 2, 3, 4, 5, 6],
                   params=SamplingParams(max_tokens=40, temperature=0))
    scheduler.add_request([seq])
    _run_step(scheduler, {})  # prefill: 6 computed, 7 tokens, 2 blocks
    assert (seq.num_computed_tokens, seq.num_tokens, len(seq.block_table)) == (6, 7, 2)
    # 7 tokens + 6 proposals: slots for 13 tokens (4 blocks) in the step.
    seq.spec_token_ids = [20, 21, 22, 23, 24, 25]
    out = _run_step(scheduler, {seq.seq_id: 1})
    assert out.scheduled[0].num_new_tokens == 7 and out.scheduled[0].spec_token_ids == (20, 21, 22, 23, 24, 25)
    # Kept: the last token and 1 proposal (8 computed), plus the model's token: 9 tokens.
    assert seq.output_token_ids == [11, 20, 11]
    assert (seq.num_computed_tokens, seq.num_tokens, len(seq.block_table)) == (8, 9, 2)
    assert bm.num_free_blocks == 30 and seq.spec_token_ids == []
    if caching:  # only the full blocks of accepted tokens are cached: [1..4], [5, 6, 11, 20]
        assert seq.num_cached_blocks == 2 and bm.num_cached_blocks == 2
    # All rejected: the blocks are what a non-speculative step holds (9 computed: 3 blocks).
    seq.spec_token_ids = [30, 31, 32, 33]
    _run_step(scheduler, {seq.seq_id: 0})
    assert (seq.num_computed_tokens, seq.num_tokens, len(seq.block_table)) == (9, 10, 3)
    assert bm.num_free_blocks == 29
    # All accepted: 9 + 1 + 3 computed, 14 tokens.
    seq.spec_token_ids = [40, 41, 42]
    _run_step(scheduler, {seq.seq_id: 3})
    assert seq.output_token_ids[-4:] == [40, 41, 42, 11]
    assert (seq.num_computed_tokens, seq.num_tokens, len(seq.block_table)) == (13, 14, 4)
    bm.check_invariants([seq])
    scheduler.finish(seq)
    assert bm.num_free_blocks == 32


def test_proposals_past_the_budget_are_dropped_and_preemption_clears_them():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3,
                                          max_model_len=16), bm)
    seq = Sequence(request_id="r", prompt_token_ids=[1, 2, 3],
                   params=SamplingParams(max_tokens=10, temperature=0))
    scheduler.add_request([seq])
    _run_step(scheduler, {})
    seq.spec_token_ids = [5, 6, 7, 8]
    out = _run_step(scheduler, {seq.seq_id: 2})  # budget 3: the last token + 2 proposals
    assert out.scheduled[0].spec_token_ids == (5, 6) and out.scheduled[0].samples
    assert seq.output_token_ids == [11, 5, 6, 11] and seq.num_computed_tokens == 6
    # 7 tokens and 2 proposals need 3 blocks; a sequence taking 2 of the 4 leaves too few: the
    # speculating sequence is preempted (the last running) and forgets its proposals.
    other = Sequence(request_id="o", prompt_token_ids=[9] * 8, params=SamplingParams(max_tokens=2))
    bm.allocate_slots(other, 8)
    seq.spec_token_ids = [1, 2]
    out = scheduler.schedule()
    assert out.preempted == [seq.seq_id] and not out.scheduled
    assert seq.spec_token_ids == [] and seq.num_computed_tokens == 0 and bm.num_free_blocks == 2


# ---- config ------------------------------------------------------------------------------------

def test_config_from_json_and_refusals():
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, '
                                         '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min,
            config.disable_by_batch_size) == (5, 3, 1, 8)
    draft = SpeculativeConfig.from_json('{"model": "/models/small", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/small", 3)
    for bad, words in [('{"method": "draft_model"}', "needs a model"), ("[1]", "JSON object"),
                       ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "ngram", "model": "x"}', "only it takes one"),
                       ('{"model": 3}', "non-empty string"), ('{"draft": "x"}', "unsupported key"),
                       ("{", "not valid JSON"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"num_speculative_tokens": "3"}', "must be an integer")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.from_json(bad)
    model = ModelConfig("m", ("m",))
    for kwargs, words in [({"parallel": ParallelConfig(pipeline_parallel_size=2)}, "pipeline"),
                          ({"parallel": ParallelConfig(tensor_parallel_size=2)}, "tensor"),
                          ({"lora": LoRAConfig(enabled=True)}, "LoRA")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(model=model, speculative=config, **kwargs)


# ---- acceptance ----------------------------------------------------------------------------------

def test_greedy_run_keeps_proposals_while_they_are_the_argmax():
    assert _greedy_run((5, 6, 7), [5, 6, 8, 9]) == [5, 6, 8]
    assert _greedy_run((5, 6), [5, 6, 4]) == [5, 6, 4]
    assert _greedy_run((5, 6), [3, 6, 4]) == [3]


def test_sampled_run_leaves_the_distribution_unchanged():
    """With proposals (d1, d2) = (1, 3) and rows p0, p1, p2: the first emitted token must follow
    p0, and, when it is d1, the second must follow p1 (what plain sampling of two tokens gives).
    Chi-square on 20k runs, fixed seed; p < 1e-3 fails."""
    p = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1, 0.0],
                      [0.3, 0.1, 0.2, 0.2, 0.15, 0.05],
                      [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    row = SamplingRow(params=SamplingParams(temperature=1.0), prompt_token_ids=[0],
                      output_token_ids=[], generator=make_generator(1234))
    rows = [row] * 3
    num_runs = 20_000
    first = np.zeros(6)
    second = np.zeros(6)
    lengths = np.zeros(4)
    for _ in range(num_runs):
        emitted = _sampled_run((1, 3), p, rows)
        lengths[len(emitted)] += 1
        first[emitted[0]] += 1
        if emitted[0] == 1:
            second[emitted[1]] += 1
    assert first[5] == 0  # probability 0 is never drawn, not even as a rejection's resample
    def expected(probs, total):
        probs = probs.double().numpy()
        return probs / probs.sum() * total

    assert chisquare(first[:5], expected(p[0, :5], num_runs)).pvalue > 1e-3
    assert chisquare(second, expected(p[1], second.sum())).pvalue > 1e-3
    # Both kept (then a bonus token) with probability p0(1) * p1(3) = 0.1.
    assert abs(lengths[3] / num_runs - 0.1) < 0.01


def test_sampled_run_with_a_draft_distribution_leaves_the_target_distribution_unchanged():
    """A draft model's proposals are drawn from its own q (not a point mass): keep d with
    probability min(1, p(d) / q(d)), else resample from max(0, p - q). Whatever q is, the first
    emitted token must follow p0 and the second (after a kept first) p1; the first is kept with
    probability sum_x min(p0(x), q0(x)). Chi-square on 20k runs, fixed seeds; p < 1e-3 fails."""
    p = torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.1, 0.0],
                      [0.3, 0.1, 0.2, 0.2, 0.15, 0.05],
                      [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.4, 0.1, 0.1, 0.2, 0.0, 0.2],  # puts mass where p has none (token 5)
                      [0.05, 0.05, 0.6, 0.1, 0.1, 0.1]])
    row = SamplingRow(params=SamplingParams(temperature=1.0), prompt_token_ids=[0],
                      output_token_ids=[], generator=make_generator(99))
    draft_generator = torch.Generator().manual_seed(7)
    num_runs = 20_000
    first, second = np.zeros(6), np.zeros(6)
    num_kept = 0
    for _ in range(num_runs):
        proposals = tuple(int(torch.multinomial(q[j], 1, generator=draft_generator)) for j in range(2))
        emitted = _sampled_run(proposals, p, [row] * 3, q)
        first[emitted[0]] += 1
        if len(emitted) >= 2:
            num_kept += 1
            second[emitted[1]] += 1
    assert first[5] == 0  # q's mass on a token p never draws is always rejected

    def expected(probs, total):
        probs = probs.double().numpy()
        return probs / probs.sum() * total

    assert chisquare(first[:5], expected(p[0, :5], num_runs)).pvalue > 1e-3
    assert chisquare(second, expected(p[1], second.sum())).pvalue > 1e-3
    assert abs(num_kept / num_runs - float(torch.minimum(p[0], q[0]).sum())) < 0.015


# ---- metrics -------------------------------------------------------------------------------------

def test_metrics_export_acceptance_rate_and_tokens_per_step():
    from prometheus_client import generate_latest

    from llmplatform.llm.base import LoadStats
    from llmplatform.metrics.worker import WorkerLoad, WorkerMetrics

    def text(stats):
        metrics = WorkerMetrics("m", lambda: WorkerLoad(stats, 0))
        return generate_latest(metrics.registry).decode()

    exposed = text(LoadStats(num_running=1, num_waiting=0, spec_num_drafts=10,
                             spec_num_draft_tokens=40, spec_num_accepted_tokens=30))
    assert 'llmplatform:spec_decode_num_drafts_total{model_name="m"} 10.0' in exposed
    assert 'llmplatform:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0' in exposed
    assert 'llmplatform:spec_decode_acceptance_rate{model_name="m"} 0.75' in exposed
    assert 'llmplatform:spec_decode_tokens_per_step{model_name="m"} 4.0' in exposed
    assert "spec_decode" not in text(LoadStats(num_running=0, num_waiting=0))  # not speculating
