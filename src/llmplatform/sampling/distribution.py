"""The distribution a sampled row draws from, and the draw (sampling.sampler).

:func:`probabilities`: the processed logits over the row's temperature, softmaxed; then top-k,
top-p and min-p, each of which keeps the row's tokens from its most likely down to some
probability, so together they are one threshold per row: the tokens below it are zeroed and the
rest renormalised. Top-k and top-p are found without sorting the vocabulary: a row's nucleus is
looked for among its ``NUCLEUS_CANDIDATES`` most likely tokens (``torch.topk``), and further only
when it reaches past them. A sort of a 49k vocabulary takes ~1.5 ms a row on two CPU cores, as
long as a small model's whole decode step; docs/performance.md, "Sampling", has the numbers.
Tokens as likely as the last one kept are kept too (a tie at the threshold).

:func:`draw`: one token per row, by inverting the row's cumulative distribution at one uniform
number, or for a seeded row by the exponential race on its own generator (robust to the last-bit
differences batching makes in its logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from llmplatform.sampling.sampler import SamplingRow

# Where a row with top-p and no top-k looks for its nucleus: among this many of its most likely
# tokens, then among the next number, then in its whole vocabulary. A language model's nucleus
# is usually a few dozen tokens (the default model's: p99 62 at temperature 0.7 and top-p 0.9;
# at temperature 1 and top-p 0.95, 13% of rows past 256 and none past 4,096).
NUCLEUS_CANDIDATES = (256, 4096)
# The draw sums probabilities by blocks of this many tokens, then inside one block.
DRAW_BLOCK = 256


def probabilities(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``[num_rows, vocab]`` processed logits -> each row's distribution after its temperature,
    top-k, top-p and min-p (rows summing to one)."""
    temperature = torch.tensor([r.params.temperature for r in rows], device=processed.device)
    probs = torch.softmax(processed / temperature.unsqueeze(1), dim=-1)
    thresholds = _thresholds(probs, rows)
    if thresholds is not None:  # in place: each new [rows, vocab] tensor costs page faults
        probs.masked_fill_(probs < thresholds.unsqueeze(1), 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def _thresholds(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
    """Per row, the probability below which its tokens go (0: none go); None when no row filters."""
    num_rows, vocab_size = probs.shape
    # A top_k at or above the vocabulary is no filter; clamping also keeps huge wire values
    # (up to 2**63 and beyond) out of the int64 tensor below.
    top_k = [min(r.params.top_k or vocab_size, vocab_size) for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    nucleus_rows = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if k < vocab_size or p < 1.0]
    if not nucleus_rows and not any(p > 0.0 for p in min_p):
        return None
    thresholds = torch.zeros(num_rows, dtype=probs.dtype, device=probs.device)
    if len(nucleus_rows) == num_rows:
        thresholds = _nucleus_thresholds(probs, top_k, top_p)
    elif nucleus_rows:
        thresholds[nucleus_rows] = _nucleus_thresholds(probs[nucleus_rows], [top_k[i] for i in nucleus_rows],
                                                       [top_p[i] for i in nucleus_rows])
    if any(p > 0.0 for p in min_p):
        # min_p is a fraction of the most likely token's probability, which top-k and top-p
        # always keep: the same fraction before their renormalisation.
        relative = torch.tensor(min_p, dtype=probs.dtype, device=probs.device) * probs.amax(dim=-1)
        thresholds = torch.maximum(thresholds, relative)
    return thresholds


def _nucleus_thresholds(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per row, the probability of the last token its top-k and top-p keep: of its top-k, the
    smallest set of its most likely tokens whose probability (renormalised over the top-k)
    reaches its top-p. Looked for among each row's most likely tokens (its top-k, or the
    NUCLEUS_CANDIDATES tiers), and further only for the rows whose nucleus reaches past them."""
    vocab_size = probs.shape[1]
    thresholds = torch.empty(probs.shape[0], dtype=probs.dtype, device=probs.device)
    rest = list(range(len(top_k)))
    looked_at = 0
    for tier in (*NUCLEUS_CANDIDATES, vocab_size):
        # A row with top-k is decided by the first pass, which takes every row's top-k.
        count = min(max([tier] + [top_k[i] for i in rest if top_k[i] < vocab_size]), vocab_size)
        if count <= looked_at:
            continue
        looked_at = count
        whole = len(rest) == len(top_k)
        found, decided = _threshold_among(probs if whole else probs[rest], [top_k[i] for i in rest],
                                          [top_p[i] for i in rest], count)
        if whole:
            thresholds = found
        else:
            thresholds[rest] = found
        rest = [i for i, done in zip(rest, decided.tolist()) if not done]
        if not rest:
            return thresholds
    raise AssertionError("the whole vocabulary decides every row")


def _threshold_among(probs: torch.Tensor, top_k: list[int], top_p: list[float], count: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_nucleus_thresholds` among each row's ``count`` most likely tokens (each row's
    top-k is at most ``count``). Also returns, per row, whether that decided it: not for a row
    without top-k whose candidates hold less probability than its top-p."""
    device = probs.device
    vocab_size = probs.shape[1]
    values = probs.topk(count, dim=-1).values  # most likely first
    k = torch.tensor(top_k, device=device)
    # top_p 1 is no filter (such a row is here for its top-k): a float sum may reach 1 early.
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], dtype=torch.float64, device=device)
    inside_k = torch.arange(count, device=device).unsqueeze(0) < k.unsqueeze(1)
    candidates = values.masked_fill(~inside_k, 0.0).double()  # float64 sums: exact boundaries
    has_k = k < vocab_size
    # Renormalised over the top-k for a row with one (all of it is among the candidates), else
    # over the vocabulary.
    mass = torch.where(has_k, candidates.sum(dim=-1), probs.sum(dim=-1).double())
    cumulative = candidates.cumsum(dim=-1) / mass.unsqueeze(1)
    # A token stays while the tokens more likely than it hold less than top_p (so the most
    # likely one always stays): the kept ones are a prefix of the candidates.
    kept = inside_k & (cumulative - candidates / mass.unsqueeze(1) < p.unsqueeze(1))
    last = kept.sum(dim=-1, keepdim=True) - 1
    decided = has_k | (cumulative[:, -1] >= p) | (count == vocab_size)
    return values.gather(1, last).squeeze(1), decided


def draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row of ``probs`` (rows need not sum to one; a zero-probability token is
    never drawn).

    An unseeded row inverts its cumulative distribution at one uniform number: the first token
    whose running sum passes ``u * total``. The sums are float64 (in float32 a 49k-token running
    sum would misplace the tail's small probabilities) over blocks of DRAW_BLOCK tokens and then
    inside the one block the uniform falls in, so the float64 work stays small.

    A seeded row runs the exponential race instead, ``argmax(p / E)`` with one ``E ~ Exp(1)`` per
    token from the row's own generator, so its choice does not depend on the other rows. The race
    also keeps a seeded request's tokens when the rows batched with it move its logits in their
    last bits (the race's winner changes only when two tokens nearly tie; an inverted running sum
    drifts across the vocabulary and moves every boundary in the tail). It draws a number per
    token, ~8x the cost of the inversion.
    """
    num_rows = probs.shape[0]
    token_ids = torch.empty(num_rows, dtype=torch.long, device=probs.device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == num_rows:
        return _invert_cumulative(probs)
    if unseeded:
        token_ids[unseeded] = _invert_cumulative(probs[unseeded])
    for i, row in enumerate(rows):
        if row.generator is not None:
            exponential = torch.rand(probs.shape[1], generator=row.generator, device=probs.device).log_().neg_()
            token_ids[i] = (probs[i] / exponential).argmax()
    return token_ids


def _invert_cumulative(probs: torch.Tensor) -> torch.Tensor:
    """``draw`` for unseeded rows: one uniform each, from torch's global generator."""
    num_rows, vocab_size = probs.shape
    device = probs.device
    uniforms = torch.rand(num_rows, dtype=torch.float64, device=device)
    padding = -vocab_size % DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, padding)) if padding else probs).reshape(num_rows, -1, DRAW_BLOCK)
    block_sums = blocks.sum(dim=-1).double()  # each a float32 sum of DRAW_BLOCK: ~1e-7 of its mass
    block_cumulative = block_sums.cumsum(dim=-1)
    targets = uniforms * block_cumulative[:, -1]
    block = _first_past(block_cumulative, targets).unsqueeze(1)
    # Where the target falls within its block's mass, as a fraction, then among its tokens.
    fraction = ((targets - (block_cumulative.gather(1, block) - block_sums.gather(1, block)).squeeze(1))
                / block_sums.gather(1, block).squeeze(1)).clamp(min=0.0)
    inside = blocks[torch.arange(num_rows, device=device), block.squeeze(1)].cumsum(dim=-1, dtype=torch.float64)
    return block.squeeze(1) * DRAW_BLOCK + _first_past(inside, fraction * inside[:, -1])


def _first_past(cumulative: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row of ``cumulative`` (running sums), the first index whose sum passes its target. A
    target is kept below its row's total, so one does: ``u * total`` may round up to the total."""
    total = cumulative[:, -1]
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, targets.unsqueeze(1), right=True).squeeze(1)
