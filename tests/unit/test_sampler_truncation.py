"""Top-k / top-p / min-p over a realistic vocabulary, and the draw (sampling.distribution),
without a sort of the vocabulary: each row's nucleus is looked for among its most likely tokens
and over the whole vocabulary only when it is not among them. Checked against the textbook
definition (sort the whole row, keep the smallest prefix reaching p) token for token, on peaked
and flat rows, mixed in one batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from llmplatform.sampling import distribution
from llmplatform.sampling.distribution import draw, probabilities
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.sampler import Sampler, SamplingRow, make_generator

VOCAB = 4096


def reference(logits: torch.Tensor, top_k: int | None, top_p: float, min_p: float) -> torch.Tensor:
    """One row ([vocab]) filtered by the definitions: sort the whole row; top-k; of what is left,
    renormalised, the smallest prefix whose probability reaches top_p; then min-p."""
    vocab = logits.shape[0]
    order = logits.sort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    kept = order.values[:top_k or vocab]
    probs = torch.softmax(kept.double(), dim=0)
    cumulative = 0.0
    for rank, prob in enumerate(probs.tolist()):
        if rank > 0 and cumulative >= top_p:
            break
        keep[order.indices[rank]] = True
        cumulative += prob
    filtered = logits.masked_fill(~keep, float("-inf"))
    if min_p > 0:
        probs = torch.softmax(filtered, dim=0)
        filtered = filtered.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return filtered


def rows_of(params: list[dict]) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(**p), [], []) for p in params]


def batch_logits(num_rows: int, seed: int) -> torch.Tensor:
    """Rows of three shapes: peaked (a language model's usual step: the nucleus is a few
    tokens), moderately spread, and flat (the nucleus is most of the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    scales = [8.0, 3.0, 0.05]
    return torch.stack([torch.randn(VOCAB, generator=generator) * scales[i % 3] for i in range(num_rows)])


PARAMS = [
    {"top_p": 0.9}, {"top_p": 0.5}, {"top_p": 0.99}, {"top_k": 40}, {"top_k": 40, "top_p": 0.8},
    {"top_k": 600, "top_p": 0.95}, {}, {"min_p": 0.05}, {"top_p": 0.9, "min_p": 0.1}, {"top_k": 1},
    {"top_p": 1e-6}, {"top_k": VOCAB + 5, "top_p": 0.7},
]


@pytest.mark.parametrize("candidates", [(256, 4096), (16, 512)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncation_matches_the_definition_token_for_token(candidates, seed, monkeypatch):
    # (16, 512): rows are decided by each of the three passes (the next test shows it).
    monkeypatch.setattr(distribution, "NUCLEUS_CANDIDATES", candidates)
    params = PARAMS * 3  # each parameter set on a peaked, a spread and a flat row
    logits = batch_logits(len(params), seed)
    got = probabilities(logits.clone(), rows_of(params))
    for i, p in enumerate(params):
        expected = torch.softmax(reference(logits[i], p.get("top_k"), p.get("top_p", 1.0), p.get("min_p", 0.0))
                                 .double(), dim=0)
        assert torch.equal(got[i] > 0, expected > 0), (i, p)
        torch.testing.assert_close(got[i].double(), expected, rtol=1e-5, atol=1e-9)


def test_each_pass_decides_the_rows_whose_nucleus_it_holds(monkeypatch):
    monkeypatch.setattr(distribution, "NUCLEUS_CANDIDATES", (16, 512))
    passes = []
    looked_at = distribution._threshold_among

    def spy(probs, top_k, top_p, count):
        thresholds, decided = looked_at(probs, top_k, top_p, count)
        passes.append((count, probs.shape[0], int(decided.sum())))
        return thresholds, decided

    monkeypatch.setattr(distribution, "_threshold_among", spy)
    # peaked, spread, flat: decided among 16, among 512, and over the whole vocabulary
    probabilities(batch_logits(3, 0), rows_of([{"top_p": 0.9}] * 3))
    assert passes == [(16, 3, 1), (512, 2, 1), (VOCAB, 1, 1)]
    passes.clear()
    # A row with top-k is decided by the first pass, which takes the largest top-k.
    probabilities(batch_logits(3, 0), rows_of([{"top_k": 100, "top_p": 0.9}, {"top_p": 0.9}, {"top_k": 3}]))
    assert passes == [(100, 3, 2), (512, 1, 1)]


def test_rows_without_a_filter_are_left_alone_and_the_input_is_not_changed():
    logits = batch_logits(4, 3)
    before = logits.clone()
    got = probabilities(logits, rows_of([{}, {"top_p": 0.5}, {}, {"top_k": 3}]))
    assert torch.equal(logits, before)  # the caller's tensor
    torch.testing.assert_close(got[[0, 2]], torch.softmax(before[[0, 2]], dim=-1))
    assert int((got[3] > 0).sum()) == 3
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(4))


def test_tokens_as_likely_as_the_last_one_kept_are_kept_too():
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, :4] = torch.tensor([3.0, 2.0, 2.0, 2.0])
    got = probabilities(logits, rows_of([{"top_k": 2}, {"top_p": 0.5}]))
    assert (got[0] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]  # a three-way tie for second
    assert (got[1] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    uniform = probabilities(torch.zeros(1, VOCAB), rows_of([{"top_p": 0.9}]))
    assert bool((uniform > 0).all())  # every token ties: none can go


def test_the_draw_follows_a_large_vocabularys_distribution():
    generator = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(VOCAB, generator=generator) * 2, dim=0)
    probs[probs < probs.median()] = 0.0  # half the vocabulary impossible
    probs /= probs.sum()
    torch.manual_seed(7)
    num_draws = 20_000
    counts = Counter(draw(probs.expand(num_draws, -1), rows_of([{}] * num_draws)).tolist())
    assert all(probs[t] > 0 for t in counts)
    # The 20 most likely tokens, each against its binomial spread (5 sigma).
    for token in probs.topk(20).indices.tolist():
        expected = num_draws * float(probs[token])
        assert abs(counts[token] - expected) < 5 * (expected * (1 - float(probs[token]))) ** 0.5, token


def test_a_uniform_at_the_top_of_its_range_draws_the_last_possible_token(monkeypatch):
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    below_one = 1.0 - 2.0**-53
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((a[0],) if a and a[0] else (), below_one,
                                                                    dtype=torch.float64))
    assert draw(probs * 3.0, rows_of([{}])).tolist() == [3]  # unnormalised too
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros((a[0],) if a and a[0] else (),
                                                                   dtype=torch.float64))
    assert draw(probs, rows_of([{}])).tolist() == [1]  # the first possible one, not token 0


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    logits = batch_logits(6, 9)
    sampler = Sampler(tokenizer=None)
    seeded = lambda: SamplingRow(SamplingParams(temperature=0.9, top_p=0.95, seed=11), [], [],  # noqa: E731
                                 generator=make_generator(11))
    alone = [sampler(logits[1:2], [seeded()])[0][0] for _ in range(3)]
    assert len(set(alone)) == 1
    others = rows_of([{"temperature": 1.0}] * 5)
    in_batch = sampler(logits, [others[0], seeded(), *others[1:]])[0][1]
    assert in_batch == alone[0]


def test_the_draw_across_block_edges_and_a_padded_last_block():
    probs = torch.zeros(1, 1000)  # blocks of 256: the last one padded
    probs[0, [255, 256, 999]] = torch.tensor([0.2, 0.3, 0.5])
    torch.manual_seed(3)
    num_draws = 6000
    counts = Counter(draw(probs.expand(num_draws, -1), rows_of([{}] * num_draws)).tolist())
    assert set(counts) == {255, 256, 999}
    for token, p in ((255, 0.2), (256, 0.3), (999, 0.5)):
        assert abs(counts[token] - num_draws * p) < 5 * (num_draws * p * (1 - p)) ** 0.5


def test_a_seeded_draw_keeps_its_token_when_the_logits_move_in_their_last_bits():
    # A long-tailed row (temperature 1, no truncation): much of its probability is in tokens of
    # ~1e-5 each. Batching moves a model's float32 logits by ~1e-4; a seeded request must keep
    # its tokens. Inverting the running sum with the same uniforms does not (it drifts past
    # tail boundaries): why seeded rows run the exponential race.
    generator = torch.Generator().manual_seed(21)
    logits = torch.randn(1, VOCAB, generator=generator) * 1.5
    moved = logits + 1e-4 * torch.randn(1, VOCAB, generator=generator)
    probs, moved_probs = probabilities(logits, rows_of([{}])), probabilities(moved, rows_of([{}]))

    def seeded(seed):
        return [SamplingRow(SamplingParams(temperature=1.0, seed=seed), [], [], generator=make_generator(seed))]

    first = [int(draw(probs, seeded(s))[0]) for s in range(300)]
    assert len(set(first)) > 200  # really spread over the tail
    assert [int(draw(moved_probs, seeded(s))[0]) for s in range(300)] == first
    inverted = []
    for p in (probs, moved_probs):
        torch.manual_seed(0)
        inverted.append([int(distribution._invert_cumulative(p)[0]) for _ in range(300)])
    assert inverted[0] != inverted[1]
