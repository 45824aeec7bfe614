"""Batched sampling from logits, shared by every backend.

One call handles a batch of rows, each with its own :class:`SamplingParams`; the work is tensor
ops over the batch, with per-row Python only where a row needs its own random generator (a seeded
request must draw the same numbers whatever else is in the batch).

Order of operations (the usual one, as in HF and vLLM):
penalties -> logit_bias -> grammar mask -> min_tokens mask -> greedy argmax | temperature ->
top-k -> top-p -> min-p -> draw (the last four in sampling.distribution). The min_tokens mask
comes after logit_bias so that no bias can bring back a stop id too early. Reported
log-probabilities are those of the model's raw distribution (before any processing).

Constrained rows (a row with a ``grammar``: structured outputs, forced tool calls) get their
grammar's bitmask applied after the biases, so that no bias can bring back a forbidden token;
the batch's free rows are untouched. Their stop tokens are left to the grammar (no min_tokens
mask, whatever ``ignore_eos`` says): a complete output allows only its stop tokens, and one that
is not complete allows none. The sampled tokens advance the grammars afterwards
(:func:`advance_grammars`), once the whole batch has sampled, so that a batch sampled again
row by row (the engine's fault isolation) never advances a grammar twice.

Every token id a row carries (stop ids, logit_bias keys) has been checked against the model's
vocabulary before the row gets here (``SamplingParams.check_vocab``, run by every backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from llmplatform.sampling.distribution import draw, probabilities
from llmplatform.sampling.output_processor import token_text
from llmplatform.sampling.outputs import TokenLogprob, TopLogprob
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.grammar_matcher import (
    SequenceGrammar, allocate_bitmask, apply_bitmask, fill_bitmasks,
)


@dataclass
class SamplingRow:
    """One row of the batch: its parameters and the token history the penalties look at."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    stop_token_ids: Sequence[int] = ()  # EOS + params.stop_token_ids, masked before min_tokens
    grammar: SequenceGrammar | None = None  # the row's output constraint, if any


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


class Sampler:
    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [num_rows, vocab_size] for the positions that sample. Returns one token id per
        row and, per row, its logprob record (None for rows that did not ask)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        num_rows, vocab_size = logits.shape
        device = logits.device
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self.process(logits, rows)

        greedy_rows = [r.params.greedy for r in rows]
        if all(greedy_rows):  # the common batch: no masked copy of the logits
            token_ids = logits.argmax(dim=-1)
            random_rows: list[int] = []
        else:
            greedy = torch.tensor(greedy_rows, device=device)
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            if greedy.any():
                token_ids[greedy] = logits[greedy].argmax(dim=-1)
            random_rows = (~greedy).nonzero().flatten().tolist()
        if random_rows:
            sub_rows = [rows[i] for i in random_rows]
            sub_logits = logits if len(random_rows) == num_rows else logits[random_rows]
            probs = self.probabilities(sub_logits, sub_rows)
            token_ids[random_rows] = draw(probs, sub_rows)

        ids = token_ids.tolist()
        records: list[TokenLogprob | None] = [None] * num_rows
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    records[i] = self._record(raw_logprobs[i], ids[i], row.params.logprobs or 0)
        return ids, records

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits processors, in order (penalties, logit_bias, grammar mask, min_tokens
        mask): float32 ``[num_rows, vocab]`` in, the processed logits out (greedy takes their
        argmax). Each row sees its own history (``SamplingRow``); speculative verification
        (engine.speculative) passes one row per position, each with its own prefix."""
        logits = self._apply_penalties(logits, rows)
        logits = self._apply_logit_bias(logits, rows)
        logits = self._apply_grammars(logits, rows)
        return self._mask_early_stops(logits, rows)

    @staticmethod
    def probabilities(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution a non-greedy row draws from: processed logits over its temperature,
        softmaxed, then top-k, top-p and min-p (``[num_rows, vocab]``; sampling.distribution)."""
        return probabilities(processed, rows)

    def logprob_records(self, logprobs: torch.Tensor, token_ids: Sequence[int], num_top: int
                        ) -> list[TokenLogprob]:
        """Records for already-chosen tokens (used for prompt logprobs). logprobs: [n, vocab]."""
        return [self._record(logprobs[i], int(t), num_top) for i, t in enumerate(token_ids)]

    def _record(self, row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
        top: tuple[TopLogprob, ...] = ()
        if num_top > 0:
            values, indices = row_logprobs.topk(num_top)
            top = tuple(TopLogprob(int(t), token_text(self._tokenizer, int(t)), float(v))
                        for v, t in zip(values.tolist(), indices.tolist()))
        return TokenLogprob(token_id, token_text(self._tokenizer, token_id),
                            float(row_logprobs[token_id]), top)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        presence = [r.params.presence_penalty for r in rows]
        frequency = [r.params.frequency_penalty for r in rows]
        repetition = [r.params.repetition_penalty for r in rows]
        has_output_penalty = any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency)
        has_repetition = any(r != 1.0 for r in repetition)
        if not (has_output_penalty or has_repetition):
            return logits
        num_rows, vocab_size = logits.shape
        device = logits.device
        # Per-row counts of each generated token id: [num_rows, vocab_size].
        output_counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
        if has_output_penalty:
            presence_t = torch.tensor(presence, device=device).unsqueeze(1)
            frequency_t = torch.tensor(frequency, device=device).unsqueeze(1)
            logits = logits - frequency_t * output_counts - presence_t * (output_counts > 0)
        if has_repetition:
            # HF/CTRL-style: tokens seen in the prompt or the output are made less likely.
            seen = (output_counts > 0) | (_token_counts([r.prompt_token_ids for r in rows],
                                                        vocab_size, device) > 0)
            penalty = torch.tensor(repetition, device=device).unsqueeze(1).expand_as(logits)
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """OpenAI's logit_bias: each row's biases added to its logits (one scatter for the batch,
        into a new tensor: ``logits`` may still be the caller's)."""
        row_index: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for i, row in enumerate(rows):
            for token_id, bias in row.params.logit_bias:
                row_index.append(i)
                token_ids.append(token_id)
                biases.append(bias)
        if not row_index:
            return logits
        device = logits.device
        return logits.index_put((torch.tensor(row_index, device=device), torch.tensor(token_ids, device=device)),
                                torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Each constrained row's grammar mask (a copy: ``logits`` may still be the caller's)."""
        constrained = [(i, row.grammar) for i, row in enumerate(rows) if row.grammar is not None]
        if not constrained:
            return logits
        bitmask = allocate_bitmask(len(rows), logits.shape[1])
        indices = fill_bitmasks(constrained, bitmask)
        logits = logits.clone()
        apply_bitmask(logits, bitmask, indices)
        return logits

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Stop ids may not be drawn before min_tokens (a constrained row's grammar decides
        instead). Masks a copy: ``logits`` may still be the caller's tensor (``.float()`` of
        float32 logits is the same tensor)."""
        masked: torch.Tensor | None = None
        for i, row in enumerate(rows):
            if row.grammar is not None:
                continue
            if len(row.output_token_ids) < row.params.min_tokens and row.stop_token_ids:
                if masked is None:
                    masked = logits.clone()
                masked[i, list(row.stop_token_ids)] = float("-inf")
        return logits if masked is None else masked


class GrammarRejectedError(RuntimeError):
    """A sampled token the row's grammar does not allow: its mask was not applied (a bug), never
    the client's doing."""


def advance_grammars(rows: Sequence[SamplingRow], token_ids: Sequence[int | None]
                     ) -> dict[int, GrammarRejectedError]:
    """Advance each constrained row's grammar by its sampled token (None: the row got none).
    Returns the rows whose grammar refused its token, which must not go on (their state is
    unchanged); the other rows are advanced."""
    refused: dict[int, GrammarRejectedError] = {}
    for i, (row, token_id) in enumerate(zip(rows, token_ids)):
        if row.grammar is None or token_id is None:
            continue
        if not row.grammar.accept(token_id):
            refused[i] = GrammarRejectedError(
                f"token {token_id} is not allowed by the output's grammar after "
                f"{row.grammar.num_accepted} accepted tokens")
    return refused


def _token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device
                  ) -> torch.Tensor:
    counts = torch.zeros(len(histories), vocab_size + 1, device=device)
    max_len = max((len(h) for h in histories), default=0)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad with an extra column index (vocab_size) that is dropped afterwards.
    padded = torch.full((len(histories), max_len), vocab_size, dtype=torch.long)
    for i, history in enumerate(histories):
        if history:
            padded[i, :len(history)] = torch.as_tensor(list(history), dtype=torch.long)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]
