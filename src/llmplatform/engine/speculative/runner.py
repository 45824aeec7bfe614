"""The model runner's side of speculative decoding (engine.speculative): verify each sequence's
proposals from its rows' logits and record what it emits."""

from __future__ import annotations

import torch

from llmplatform.engine.isolation import pinned_fault
from llmplatform.engine.outputs import ModelOutput
from llmplatform.engine.speculative.rejection import SpecSpan, Verified, verify
from llmplatform.sampling.sampler import Sampler

__all__ = ["SpecSpan", "verify_spans"]


def verify_spans(sampler: Sampler, logits: torch.Tensor, spans: list[SpecSpan],
                 output: ModelOutput) -> None:
    """Verifies the spans (``logits``: their rows, in order), appends what each emits to its
    runner sequence and records it in ``output`` (the proposals kept in ``output.accepted``, the
    model's own token like any sampled token). The verification is one sequence's own work: if
    the batch raises, each span is verified alone and the ones that still raise fail alone."""
    try:
        results: list[Verified | Exception] = list(verify(sampler, logits, spans))
    except Exception:
        results = []
        offset = 0
        for span in spans:
            n = len(span.rows)
            try:
                results.append(verify(sampler, logits[offset:offset + n], [span])[0])
            except Exception as exc:
                results.append(exc)
            offset += n
    for span, result in zip(spans, results):
        seq = span.seq
        if isinstance(result, Exception):
            output.errors[seq.seq_id] = pinned_fault(seq, "speculative verification", result)
            continue
        seq.output_token_ids.extend(result.accepted.token_ids)
        seq.output_token_ids.append(result.token_id)
        output.accepted[seq.seq_id] = result.accepted
        output.seq_ids.append(seq.seq_id)
        output.token_ids.append(result.token_id)
        output.logprobs.append(result.logprob)
