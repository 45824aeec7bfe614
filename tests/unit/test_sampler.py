"""The batched Sampler on hand-built logits over a small vocabulary.

Exact expectations where the math is exact (greedy, filters, penalties, logprobs); fixed torch
seeds and loose statistical bounds where it is random, so every run draws the same numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from llmplatform.sampling.output_processor import token_text
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.sampler import Sampler, SamplingRow, make_generator

VOCAB = 10


@pytest.fixture(scope="module")
def sampler(tiny_model_dir: Path) -> Sampler:
    from transformers import AutoTokenizer

    return Sampler(AutoTokenizer.from_pretrained(tiny_model_dir))


def row(prompt: Sequence[int] = (), output: Sequence[int] = (), *, seed: int | None = None,
        stop_token_ids: Sequence[int] = (), **params: Any) -> SamplingRow:
    sampling = SamplingParams(seed=seed, **params)
    return SamplingRow(sampling, list(prompt), list(output), generator=make_generator(seed),
                       stop_token_ids=tuple(stop_token_ids))


def logits_from_probs(probs: Sequence[float]) -> torch.Tensor:
    """[1, VOCAB] logits whose softmax is ``probs`` (zeros become -inf)."""
    padded = list(probs) + [0.0] * (VOCAB - len(probs))
    return torch.tensor([padded]).log()


def draw_counts(sampler: Sampler, logits: torch.Tensor, num_draws: int, **params: Any) -> Counter:
    """Samples ``num_draws`` unseeded rows of the same logits in one batch."""
    torch.manual_seed(1234)
    ids, _ = sampler(logits.expand(num_draws, -1).clone(), [row(**params) for _ in range(num_draws)])
    return Counter(ids)


def chi_square(counts: Counter, probs: Sequence[float]) -> float:
    total = sum(counts.values())
    return sum((counts.get(i, 0) - total * p) ** 2 / (total * p) for i, p in enumerate(probs) if p > 0)


# ---------------------------------------------------------------------------------------------
# Greedy and the filters


def test_greedy_is_argmax_per_row(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    rows = [row(temperature=0.0) for _ in range(6)]
    rows[2] = row(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3, seed=7)  # filters don't matter
    ids, records = sampler(logits, rows)
    assert ids == logits.argmax(dim=-1).tolist()
    assert records == [None] * 6


def test_greedy_and_random_rows_share_a_batch(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    ids, _ = sampler(logits, [row(temperature=0.0), row(top_k=1), row(temperature=0.0), row(top_k=1)])
    assert ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_at_temperature_one_is_argmax(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 0.1  # nearly uniform: an unfiltered draw would vary
    counts = draw_counts(sampler, logits, 300, temperature=1.0, top_k=1)
    assert counts == Counter({int(logits.argmax()): 300})


def test_top_k_keeps_exactly_k_tokens(sampler: Sampler) -> None:
    logits = logits_from_probs([0.3, 0.25, 0.2, 0.15, 0.1])
    counts = draw_counts(sampler, logits, 1000, top_k=2)
    assert set(counts) == {0, 1}


def test_huge_top_k_is_no_filter_and_does_not_overflow(sampler: Sampler) -> None:
    # A top_k beyond int64 (valid on the wire: "a positive integer") must not crash the batch.
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    counts = draw_counts(sampler, logits, 300, top_k=2**70, top_p=0.95)
    assert set(counts) <= {0, 1, 2, 3} and len(counts) >= 3


def test_tiny_top_p_keeps_only_the_top_token(sampler: Sampler) -> None:
    logits = logits_from_probs([0.2, 0.21, 0.19, 0.2, 0.2])
    counts = draw_counts(sampler, logits, 300, top_p=1e-6)
    assert counts == Counter({1: 300})


def test_top_p_keeps_the_smallest_set_reaching_p(sampler: Sampler) -> None:
    # Cumulative: 0.4, 0.7, 0.9, 1.0. With p=0.5 the top two are needed; the third is not.
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    counts = draw_counts(sampler, logits, 1000, top_p=0.5)
    assert set(counts) == {0, 1}
    assert chi_square(counts, [4 / 7, 3 / 7]) < 15.0  # renormalised over the kept two


def test_min_p_filters_below_a_fraction_of_the_top_probability(sampler: Sampler) -> None:
    # min_p 0.2 of the top 0.5 -> threshold 0.1: 0.15 stays, 0.05 and 0.04 go.
    probs = [0.5, 0.26, 0.15, 0.05, 0.04]
    counts = draw_counts(sampler, logits_from_probs(probs), 2000, min_p=0.2)
    assert set(counts) == {0, 1, 2}
    assert chi_square(counts, [p / 0.91 for p in probs[:3]]) < 15.0


def test_temperature_sharpens_the_distribution(sampler: Sampler) -> None:
    probs = [0.5, 0.3, 0.2]
    counts = draw_counts(sampler, logits_from_probs(probs), 4000, temperature=0.5)
    squared = [p * p for p in probs]
    expected = [p / sum(squared) for p in squared]
    assert chi_square(counts, expected) < 15.0
    assert chi_square(counts, probs) > 100.0  # clearly not the untempered distribution


def test_unseeded_draws_follow_the_probabilities(sampler: Sampler) -> None:
    probs = [0.4, 0.25, 0.15, 0.1, 0.05, 0.05]
    counts = draw_counts(sampler, logits_from_probs(probs), 5000)
    assert set(counts) <= set(range(len(probs)))  # zero-probability tokens never come up
    # 5 degrees of freedom: the 0.1% critical value is 20.5.
    assert chi_square(counts, probs) < 20.5


def test_seeded_draws_follow_the_probabilities(sampler: Sampler) -> None:
    probs = [0.5, 0.3, 0.2]
    logits = logits_from_probs(probs)
    seeded = row(seed=2024)
    counts = Counter(sampler(logits, [seeded])[0][0] for _ in range(1500))
    assert chi_square(counts, probs) < 13.8  # 2 degrees of freedom, 0.1%


# ---------------------------------------------------------------------------------------------
# Penalties


def test_frequency_and_presence_penalties_exact_values(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.5, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    penalised = Sampler._apply_penalties(
        logits, [row(prompt=[2, 2, 2], output=[0, 0, 3], frequency_penalty=0.3, presence_penalty=0.1)])
    expected = logits.clone()
    expected[0, 0] -= 2 * 0.3 + 0.1
    expected[0, 3] -= 1 * 0.3 + 0.1
    # Prompt tokens (id 2) are not penalised by presence/frequency (OpenAI semantics).
    torch.testing.assert_close(penalised, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("params, expected_id", [
    (dict(frequency_penalty=0.3), 1),   # 3.0 - 2*0.3 = 2.4 < 2.5
    (dict(frequency_penalty=0.2), 0),   # 3.0 - 2*0.2 = 2.6 > 2.5
    (dict(presence_penalty=0.6), 1),    # 3.0 - 0.6 = 2.4 (count does not matter)
    (dict(presence_penalty=0.4), 0),    # 3.0 - 0.4 = 2.6
    (dict(frequency_penalty=-0.5), 0),  # negative encourages repeats
])
def test_penalties_change_the_argmax(sampler: Sampler, params: dict[str, float], expected_id: int) -> None:
    logits = torch.tensor([[3.0, 2.5, 1.0] + [0.0] * (VOCAB - 3)])
    ids, _ = sampler(logits, [row(output=[0, 0], temperature=0.0, **params)])
    assert ids == [expected_id]


def test_repetition_penalty_divides_positive_and_multiplies_negative(sampler: Sampler) -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    penalised = Sampler._apply_penalties(logits, [row(prompt=[0], output=[1, 1], repetition_penalty=1.5)])
    expected = logits.clone()
    expected[0, 0] = 2.0 / 1.5    # seen in the prompt
    expected[0, 1] = -2.0 * 1.5   # seen in the output (once or twice: same)
    torch.testing.assert_close(penalised, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_changes_the_argmax(sampler: Sampler) -> None:
    logits = torch.tensor([[2.0, 1.5] + [0.0] * (VOCAB - 2)])
    # 2.0 / 1.5 = 1.33 < 1.5; 2.0 / 1.2 = 1.67 > 1.5.
    assert sampler(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.5)])[0] == [1]
    assert sampler(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=1.2)])[0] == [0]


def test_penalties_apply_per_row(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.5] + [0.0] * (VOCAB - 2)]).expand(3, -1).clone()
    rows = [row(output=[0], temperature=0.0, presence_penalty=1.0),
            row(output=[0], temperature=0.0),
            row(prompt=[0], temperature=0.0, repetition_penalty=2.0)]
    assert sampler(logits, rows)[0] == [1, 0, 1]


# ---------------------------------------------------------------------------------------------
# min_tokens


def test_min_tokens_masks_stop_ids_until_reached(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    original = logits.clone()
    early = row(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=(3, 4))
    assert sampler(logits, [early])[0] == [1]
    torch.testing.assert_close(logits, original)  # the caller's logits are not written to
    done = row(output=[1, 1], temperature=0.0, min_tokens=2, stop_token_ids=(3, 4))
    assert sampler(logits, [done])[0] == [3]
    # A random row never draws a masked id either.
    counts = draw_counts(sampler, logits, 500, min_tokens=3, stop_token_ids=(3, 4))
    assert not {3, 4} & set(counts)


def test_min_tokens_mask_does_not_leak_to_other_rows(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 5.0] + [0.0] * (VOCAB - 4)]).expand(2, -1).clone()
    rows = [row(temperature=0.0, min_tokens=1, stop_token_ids=(3,)),
            row(temperature=0.0, stop_token_ids=(3,))]
    assert sampler(logits, rows)[0] == [1, 3]


# ---------------------------------------------------------------------------------------------
# logit_bias


def test_plus_100_forces_a_token_for_greedy_and_random_rows(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    unlikely = int(logits.argmin())
    original = logits.clone()
    greedy = row(temperature=0.0, logit_bias={unlikely: 100})
    assert sampler(logits, [greedy])[0] == [unlikely]
    torch.testing.assert_close(logits, original)  # the caller's logits are not written to
    counts = draw_counts(sampler, logits, 300, temperature=1.0, logit_bias={str(unlikely): 100.0})
    assert counts == Counter({unlikely: 300})


def test_minus_100_bans_the_argmax(sampler: Sampler) -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB) * 3
    top, second = logits[0].topk(2).indices.tolist()
    assert sampler(logits, [row(temperature=0.0)])[0] == [top]
    assert sampler(logits, [row(temperature=0.0, logit_bias={top: -100})])[0] == [second]
    counts = draw_counts(sampler, logits, 300, logit_bias={top: -100})
    assert top not in counts and len(counts) > 1


def test_logit_bias_is_added_to_the_logits(sampler: Sampler) -> None:
    # Equal logits; a bias of 1.0 on token 2 makes it e times as likely as each other token:
    # added, not multiplied or clamped. Reported logprobs stay the raw distribution's.
    logits = torch.zeros(1, VOCAB)
    counts = draw_counts(sampler, logits, 4000, logit_bias={2: 1.0})
    expected = [1.0] * VOCAB
    expected[2] = math.e
    probs = [p / sum(expected) for p in expected]
    assert chi_square(counts, probs) < 30  # 9 degrees of freedom: p ~ 0.0004
    _, records = sampler(logits, [row(temperature=0.0, logprobs=0, logit_bias={2: 100})])
    assert records[0].token_id == 2 and records[0].logprob == pytest.approx(-math.log(VOCAB))


def test_logit_bias_rows_are_independent(sampler: Sampler) -> None:
    # Four rows of the same logits in one batch: each row's bias applies to that row only, and
    # rows without a bias sample as they would alone.
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB).expand(5, -1).clone()
    top = int(logits[0].argmax())
    others = [t for t in logits[0].argsort(descending=True).tolist() if t != top]
    rows = [row(temperature=0.0, logit_bias={others[3]: 100}),
            row(temperature=0.0),
            row(temperature=0.0, logit_bias={top: -100}),
            row(temperature=0.0, logit_bias={others[5]: 100, top: -100}),
            row(seed=5, logit_bias={others[1]: 100})]
    ids, _ = sampler(logits, rows)
    assert ids == [others[3], top, others[0], others[5], others[1]]


def test_min_tokens_wins_over_a_forcing_bias(sampler: Sampler) -> None:
    # A stop id may not be drawn before min_tokens, whatever its bias.
    logits = torch.zeros(1, VOCAB)
    early = row(output=[1], temperature=0.0, min_tokens=3, stop_token_ids=(4,), logit_bias={4: 100})
    assert sampler(logits, [early])[0] != [4]
    done = row(output=[1, 1, 1], temperature=0.0, min_tokens=3, stop_token_ids=(4,), logit_bias={4: 100})
    assert sampler(logits, [done])[0] == [4]


# ---------------------------------------------------------------------------------------------
# Seeds


def _seeded_sequence(sampler: Sampler, seed: int, num_others: int, position: int,
                     num_steps: int = 50) -> list[int]:
    """Draws ``num_steps`` tokens for one seeded row that sits at ``position`` among
    ``num_others`` other rows (unseeded, other seeds, greedy), over fixed per-step logits."""
    steps = torch.Generator().manual_seed(99)
    target = row(seed=seed, temperature=0.9, top_p=0.95)
    others = [row(), row(seed=seed + 1), row(temperature=0.0), row(top_k=3)]
    torch.manual_seed(num_others * 31 + position)  # the unseeded rows draw different numbers
    sequence = []
    for _ in range(num_steps):
        step_logits = torch.randn(1, VOCAB, generator=steps)
        batch = [others[i % len(others)] for i in range(num_others)]
        batch.insert(position, target)
        other_logits = torch.randn(num_others, VOCAB)
        logits = torch.cat([other_logits[:position], step_logits, other_logits[position:]])
        ids, _ = sampler(logits, batch)
        sequence.append(ids[position])
        target.output_token_ids.append(ids[position])  # penalties off, but keep it realistic
    return sequence


def test_seeded_row_reproduces_and_ignores_batch_composition(sampler: Sampler) -> None:
    alone = _seeded_sequence(sampler, seed=42, num_others=0, position=0)
    assert alone == _seeded_sequence(sampler, seed=42, num_others=0, position=0)
    assert len(set(alone)) > 3  # really random, not argmax
    assert alone == _seeded_sequence(sampler, seed=42, num_others=5, position=0)
    assert alone == _seeded_sequence(sampler, seed=42, num_others=7, position=4)
    assert alone != _seeded_sequence(sampler, seed=43, num_others=0, position=0)


def test_make_generator_accepts_any_int_seed() -> None:
    assert make_generator(None) is None
    for seed in (0, -1, 2**64 - 1, 2**70):
        generator = make_generator(seed)
        assert isinstance(generator, torch.Generator)
    a = torch.rand(3, generator=make_generator(-1))
    b = torch.rand(3, generator=make_generator(2**64 - 1))
    torch.testing.assert_close(a, b)  # seeds are taken modulo 2**64


# ---------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_raw_log_softmax_with_ordered_top_list(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    rows = [
        # Processing that changes the distribution must not change the reported logprobs.
        row(prompt=[0, 1], output=[2], temperature=0.5, top_k=2, repetition_penalty=1.7,
            presence_penalty=1.0, logprobs=4, seed=1),
        row(temperature=0.0, logprobs=0),
        row(temperature=0.0),  # did not ask
    ]
    ids, records = sampler(logits.clone(), rows)
    raw = torch.log_softmax(logits, dim=-1)
    tokenizer = sampler._tokenizer

    first = records[0]
    assert first is not None and first.token_id == ids[0]
    assert first.logprob == pytest.approx(float(raw[0, ids[0]]), abs=1e-6)
    assert first.token == token_text(tokenizer, ids[0])
    assert len(first.top) == 4
    expected_top = raw[0].sort(descending=True)
    assert [t.token_id for t in first.top] == expected_top.indices[:4].tolist()
    assert [t.logprob for t in first.top] == pytest.approx(expected_top.values[:4].tolist(), abs=1e-6)
    assert all(a.logprob >= b.logprob for a, b in zip(first.top, first.top[1:]))
    assert [t.token for t in first.top] == [token_text(tokenizer, t.token_id) for t in first.top]

    second = records[1]
    assert second is not None and second.top == ()
    assert second.token_id == int(logits[1].argmax())
    assert second.logprob == pytest.approx(float(raw[1].max()), abs=1e-6)
    assert records[2] is None


def test_logprob_records_for_given_tokens(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(3, VOCAB), dim=-1)
    records = sampler.logprob_records(logprobs, [4, 0, 9], num_top=2)
    assert [r.token_id for r in records] == [4, 0, 9]
    for i, record in enumerate(records):
        assert record.logprob == pytest.approx(float(logprobs[i, record.token_id]))
        assert [t.token_id for t in record.top] == logprobs[i].topk(2).indices.tolist()


def test_half_precision_logits_are_accepted(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    ids, records = sampler(logits, [row(temperature=0.0, logprobs=1), row(seed=3)])
    assert ids[0] == int(logits[0].float().argmax())
    assert records[0] is not None and math.isfinite(records[0].logprob)
