"""Verifying proposals so that the output is the one plain decoding gives (engine.speculative).

A sequence with proposals ``d_1 .. d_K`` has K + 1 rows of logits from the step's forward pass:
row ``j`` is the model's next-token distribution after its tokens and ``d_1 .. d_j``. Each row is
processed as the sampler processes a decode row with exactly that history (penalties, logit_bias
and the min_tokens mask see ``output + d_1 .. d_j``), so every position's processors see its
correct prefix. Then, for j = 0, 1, ...:

- greedy: ``d_{j+1}`` is kept while it is the argmax of row j; the first row whose argmax differs
  gives the model's own token and ends the run. Token for token what plain greedy decoding emits.
- sampling, standard speculative sampling: with ``p`` row j's distribution (after temperature,
  top-k, top-p, min-p) and ``q`` the one ``d`` was drawn from, keep ``d`` with probability
  ``min(1, p(d) / q(d))``; on rejection, draw from ``max(0, p - q)`` normalised. The emitted
  token is then distributed exactly as ``p``: ``P(x) = min(q(x), p(x)) + (1 - sum_y min(q(y),
  p(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = p(x)``. A draft model's ``q`` comes
  with the proposals (``SpecSpan.draft_probs``); the n-gram draft is certain, a point mass on
  ``d``, which reduces this to: keep ``d`` with probability ``p(d)``, else draw from ``p`` with
  ``d`` removed and renormalised.

When all K are kept, row K gives one more token the usual way (the bonus). A seeded sequence
draws its uniforms and tokens from its own generator (reproducible, though not the same numbers
as a non-speculative run of the same seed). Logprob records are those of each emitted token in
its row's raw distribution, as plain decoding reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmplatform.engine.outputs import AcceptedTokens
from llmplatform.engine.runner_state import RunnerSequence
from llmplatform.sampling.distribution import draw
from llmplatform.sampling.outputs import TokenLogprob
from llmplatform.sampling.sampler import Sampler, SamplingRow


@dataclass(frozen=True)
class SpecSpan:
    """A sequence's chunk in the step's batch: its last token's row, then one per proposal."""

    seq: RunnerSequence
    first_row: int
    proposals: tuple[int, ...]
    # The distributions the proposals were drawn from (a draft model's, ``[>= K, vocab]``), or
    # None: each proposal certain (a point mass).
    draft_probs: torch.Tensor | None = None

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + len(self.proposals) + 1)


@dataclass(frozen=True)
class Verified:
    """What one sequence's verification yields: the proposals kept and the model's own token."""

    accepted: AcceptedTokens
    token_id: int
    logprob: TokenLogprob | None


def _position_rows(span: SpecSpan) -> list[SamplingRow]:
    seq = span.seq
    return [SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=seq.output_token_ids + list(span.proposals[:j]),
                        generator=seq.generator, stop_token_ids=seq.stop_token_ids)
            for j in range(len(span.proposals) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, spans: list[SpecSpan]) -> list[Verified]:
    """``logits``: ``[sum of len(span.rows), vocab]``, the spans' rows in order. One
    :class:`Verified` per span; appends nothing (the caller does)."""
    rows = [row for span in spans for row in _position_rows(span)]
    logits = logits.float()
    processed = sampler.process(logits, rows)  # [R, vocab]
    greedy_ids = processed.argmax(dim=-1).tolist()
    results = []
    offset = 0
    for span in spans:
        n = len(span.proposals) + 1
        span_rows = rows[offset:offset + n]
        if span.seq.params.greedy:
            emitted = _greedy_run(span.proposals, greedy_ids[offset:offset + n])
        else:
            emitted = _sampled_run(span.proposals, sampler.probabilities(
                processed[offset:offset + n], span_rows), span_rows, span.draft_probs)
        results.append(_result(sampler, span, logits[offset:offset + len(emitted)], emitted))
        offset += n
    return results


def _greedy_run(proposals: tuple[int, ...], argmax_ids: list[int]) -> list[int]:
    """The proposals kept (each the argmax of its row), then the first row's argmax that is not."""
    emitted = []
    for proposal, target in zip(proposals, argmax_ids):
        if proposal != target:
            break
        emitted.append(proposal)
    emitted.append(argmax_ids[len(emitted)])
    return emitted


def _sampled_run(proposals: tuple[int, ...], probs: torch.Tensor, rows: list[SamplingRow],
                 draft_probs: torch.Tensor | None = None) -> list[int]:
    """Speculative sampling (module docstring). probs: [K + 1, vocab]; draft_probs: the
    proposals' distributions ([>= K, vocab]), or None for point masses."""
    generator = rows[0].generator
    emitted = []
    for j, proposal in enumerate(proposals):
        u = torch.rand((), generator=generator, device=probs.device) if generator is not None \
            else torch.rand((), device=probs.device)
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, proposal])
        if float(u) * q_d < float(probs[j, proposal]):
            emitted.append(proposal)
            continue
        residual = probs[j:j + 1].clone()
        if draft_probs is None:
            residual[0, proposal] = 0.0
        else:
            residual = (residual - draft_probs[j:j + 1].to(residual)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p is q (or all on the proposal): nothing to correct
            residual = probs[j:j + 1].clone()
        residual /= residual.sum()
        emitted.append(int(draw(residual, [rows[j]])[0]))
        return emitted
    emitted.append(int(draw(probs[len(proposals):], [rows[len(proposals)]])[0]))
    return emitted


def _result(sampler: Sampler, span: SpecSpan, raw_logits: torch.Tensor,
            emitted: list[int]) -> Verified:
    """``raw_logits``: the unprocessed rows of the emitted tokens ([len(emitted), vocab])."""
    num_top = span.seq.params.logprobs
    if num_top is None:
        records: list[TokenLogprob | None] = [None] * len(emitted)
    else:
        records = list(sampler.logprob_records(torch.log_softmax(raw_logits, dim=-1), emitted,
                                               num_top))
    accepted = AcceptedTokens(emitted[:-1], records[:-1], len(span.proposals))
    return Verified(accepted, emitted[-1], records[-1])
