"""The model runner's pooling work: final hidden states of pooling sequences -> their vectors.

See :mod:`.pooling` for what a pooling sequence is. Each step, every scheduled chunk of a pooling
sequence is a span of rows of the step's hidden states (``[num_tokens, hidden]``, after the final
norm). ``mean`` adds the span's rows to the sequence's float32 running sum; the span that
reaches the sequence's last prompt token yields its vector (float32, normalized if asked).
A failure here is the sequence's own (reported per sequence, the others keep their vectors).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmplatform.engine.isolation import pinned_fault
from llmplatform.engine.outputs import Failure
from llmplatform.engine.pooling import PoolingMode
from llmplatform.engine.runner_state import RunnerSequence


@dataclass(frozen=True)
class PoolingSpan:
    """Rows ``[first_row, first_row + num_new_tokens)`` of the step's hidden states are positions
    ``[start, start + num_new_tokens)`` of ``seq``."""

    seq: RunnerSequence
    first_row: int
    start: int
    num_new_tokens: int


def pool_spans(hidden: torch.Tensor, spans: list[PoolingSpan]
               ) -> tuple[dict[int, np.ndarray], dict[int, Failure]]:
    """(seq id -> vector for each sequence whose prompt this step finished, seq id -> error)."""
    vectors: dict[int, np.ndarray] = {}
    errors: dict[int, Failure] = {}
    for span in spans:
        try:
            vector = _pool_span(hidden, span)
        except Exception as exc:
            errors[span.seq.seq_id] = pinned_fault(span.seq, "pooling", exc)
            continue
        if vector is not None:
            vectors[span.seq.seq_id] = vector
    return vectors, errors


def _pool_span(hidden: torch.Tensor, span: PoolingSpan) -> np.ndarray | None:
    seq = span.seq
    assert seq.pooling is not None
    end = span.start + span.num_new_tokens
    rows = hidden[span.first_row:span.first_row + span.num_new_tokens]  # [num_new_tokens, hidden]
    if seq.pooling.mode is PoolingMode.MEAN:
        chunk_sum = rows.float().sum(dim=0)  # [hidden]
        if span.start == 0:
            seq.pooling_sum = chunk_sum
        else:
            # A mean pool never starts from a prefix-cache hit: every earlier chunk added its rows.
            assert seq.pooling_sum is not None, "mean pooling lost its earlier chunks"
            seq.pooling_sum = seq.pooling_sum + chunk_sum
    if end < seq.num_prompt_tokens:
        return None
    if seq.pooling.mode is PoolingMode.MEAN:
        pooled = seq.pooling_sum / seq.num_prompt_tokens  # [hidden]
        seq.pooling_sum = None
    else:
        pooled = rows[-1].float()  # [hidden]
    if seq.pooling.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=0)
    return pooled.cpu().numpy().astype(np.float32, copy=False)
