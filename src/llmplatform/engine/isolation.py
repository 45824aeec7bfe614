"""Keeping one request's fault that request's.

Some of a step's work is per request even when it runs batched: sampling (one row per
sequence), prompt log-probabilities, detokenizing and stop handling. When that work raises, the
fault can be pinned on the request whose row raised: that request fails alone (finish reason
ERROR, its KV blocks freed) and every other sequence of the step goes on with the token it
would have got anyway. Only a fault that cannot be pinned (the forward pass, the scheduler)
fails the step; :mod:`.async_engine` then rebuilds the engine.

:class:`IsolatingSampler` runs the batched sampler once; only if that raises does it sample the
rows one by one to find the culprit(s). The rows' grammars (structured outputs) advance only
once their tokens are final, so a retry never advances one twice; a row whose grammar refuses
its token fails alone like any other row. :func:`pinned_fault` is the one way a per-sequence fault
is logged and turned into the client's error.

Grammars whose matchers live in a grammar process (:mod:`llmplatform.sampling.grammar_sandbox`)
get their masks before the batch samples, each within the per-token budget; a row whose mask
did not come in time is the request's own fault (a 400-class error) and is left out of the
batch, so it never costs the other rows a retry.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from llmplatform.engine.outputs import Failure
from llmplatform.errors import LLMPlatformError
from llmplatform.sampling.grammar_sandbox import fill_remote_grammars
from llmplatform.sampling.outputs import TokenLogprob
from llmplatform.sampling.sampler import Sampler, SamplingRow, advance_grammars
from llmplatform.utils.logs import request_context

logger = logging.getLogger("llmplatform.engine")


class Output(Protocol):
    """Whose fault it is: one output of one request (the engine's and the runner's records)."""

    @property
    def request_id(self) -> str: ...

    @property
    def index(self) -> int: ...


def pinned_fault(seq: Output, stage: str, exc: BaseException) -> Failure:
    """Logs a fault pinned on ``seq`` (with its traceback, in its request's context) and returns
    the error its client gets. A client-class error (the request's own doing, e.g. a grammar
    past its per-token budget) keeps its message and code and is logged without a traceback."""
    if isinstance(exc, LLMPlatformError) and exc.http_status < 500:
        with request_context(seq.request_id):
            logger.info("%s refused output %d of this request: %s", stage, seq.index, exc.message)
        return Failure(exc.message, exc.error_code)
    with request_context(seq.request_id):
        logger.error("%s failed for output %d of this request; failing it alone, the other "
                     "requests go on", stage, seq.index, exc_info=exc)
    return Failure(f"this request failed during {stage} ({type(exc).__name__}: {exc}); other "
                   "requests were not affected")


@dataclass(frozen=True)
class SampledRows:
    """The sampler's answer per row: a token (and logprob record) or, for a row whose own
    sampling raised, the error for its client. Rows keep their order."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, Failure]  # row index -> the error for its client


class IsolatingSampler:
    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler

    def __call__(self, logits: torch.Tensor, rows: Seq[SamplingRow],
                 seqs: Seq[Output]) -> SampledRows:
        """logits: [num_rows, vocab_size]; ``seqs[i]`` is the sequence row i samples for.

        Raises only when no row can be blamed: every row also fails on its own (with more than
        one row that looks like the device, not the requests)."""
        refused = fill_remote_grammars([row.grammar for row in rows])
        if not refused:
            return self._sample_rows(logits, rows, seqs)
        keep = [i for i, row in enumerate(rows) if row.grammar not in refused]
        sampled = SampledRows([None] * len(rows), [None] * len(rows), {})
        for i, row in enumerate(rows):
            if row.grammar in refused:
                sampled.errors[i] = pinned_fault(seqs[i], "structured output",
                                                 refused[row.grammar])
        if keep:
            kept = self._sample_rows(logits[keep], [rows[i] for i in keep],
                                     [seqs[i] for i in keep])
            for j, i in enumerate(keep):
                sampled.token_ids[i], sampled.logprobs[i] = kept.token_ids[j], kept.logprobs[j]
                if j in kept.errors:
                    sampled.errors[i] = kept.errors[j]
        return sampled

    def _sample_rows(self, logits: torch.Tensor, rows: Seq[SamplingRow], seqs: Seq[Output]
                     ) -> SampledRows:
        # A seeded row's generator may have drawn before the batch raised; its retry must draw
        # the same numbers as a run without the fault.
        generator_states = [(row.generator, row.generator.get_state())
                            for row in rows if row.generator is not None]
        try:
            token_ids, logprobs = self._sampler(logits, rows)
            sampled = SampledRows(list(token_ids), list(logprobs), {})
        except Exception as batch_exc:
            for generator, state in generator_states:
                generator.set_state(state)
            sampled = self._one_by_one(logits, rows, seqs, batch_exc)
        for i, exc in advance_grammars(rows, sampled.token_ids).items():
            sampled.token_ids[i] = sampled.logprobs[i] = None
            sampled.errors[i] = pinned_fault(seqs[i], "structured output", exc)
        return sampled

    def _one_by_one(self, logits: torch.Tensor, rows: Seq[SamplingRow], seqs: Seq[Output],
                    batch_exc: Exception) -> SampledRows:
        token_ids: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        errors: dict[int, Failure] = {}
        failures: list[tuple[int, Exception]] = []
        for i, row in enumerate(rows):
            try:
                ids, records = self._sampler(logits[i:i + 1], [row])
            except Exception as exc:
                failures.append((i, exc))
                token_ids.append(None)
                logprobs.append(None)
                continue
            token_ids.append(ids[0])
            logprobs.append(records[0])
        if len(failures) == len(rows) and len(rows) > 1:
            raise batch_exc  # not one request's fault
        for i, exc in failures:
            errors[i] = pinned_fault(seqs[i], "sampling", exc)
        return SampledRows(token_ids, logprobs, errors)
