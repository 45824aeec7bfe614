"""One step's chunks as one flat batch (``ModelRunner._flatten``), and reading its logits back.

Layout of one step's batch (three sequences: a prefill chunk, two decodes):

    input_ids:  | seq A tokens [c_A, c_A + q_A) | seq B: 1 token | seq C: 1 token |
    positions:  | c_A ... c_A + q_A - 1         | c_B           | c_C           |
    sample row: the last token of each chunk that reaches its sequence's end

A :class:`StepBatch` says which rows each use has: sampling, prompt logprobs, pooling, LoRA
adapters, speculative verification. Pure bookkeeping over the runner's sequence records
(:mod:`.runner_state`); the runner runs the model and samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmplatform.engine.lora import RowSpan
from llmplatform.engine.outputs import SchedulerOutput
from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.engine.pooler import PoolingSpan
from llmplatform.engine.runner_state import RunnerSequence, RunnerStates
from llmplatform.engine.speculative.runner import SpecSpan
from llmplatform.sampling.output_processor import token_text
from llmplatform.sampling.outputs import TokenLogprob
from llmplatform.sampling.sampler import Sampler


@dataclass
class StepBatch:
    """One step's chunks flattened (:func:`flatten`), and which rows each use has."""

    inputs: StepInputs
    sample_rows: list[int]
    sample_seqs: list[RunnerSequence]
    # (seq, its first row, its first position, its number of new tokens)
    prompt_logprob_spans: list[tuple[RunnerSequence, int, int, int]]
    pooling_spans: list[PoolingSpan] = field(default_factory=list)
    lora_spans: list[RowSpan] = field(default_factory=list)
    spec_spans: list[SpecSpan] = field(default_factory=list)


def flatten(scheduled: SchedulerOutput, states: RunnerStates) -> StepBatch:
    """The step's chunks as one batch (the layout drawn at the top); ``states`` already hold the
    step's sequences (``RunnerStates.apply``)."""
    input_ids: list[int] = []
    positions: list[int] = []
    context_lens: list[int] = []
    query_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_rows: list[int] = []
    sample_seqs: list[RunnerSequence] = []
    # (seq, its first row, its first position, its number of new tokens)
    prompt_logprob_spans: list[tuple[RunnerSequence, int, int, int]] = []
    pooling_spans: list[PoolingSpan] = []  # chunks of pooling sequences (engine.pooler)
    lora_spans: list[RowSpan] = []  # chunks of sequences with a LoRA adapter
    spec_spans: list[SpecSpan] = []  # sequences verifying proposals (engine.speculative)
    for item in scheduled.scheduled:
        seq = states[item.seq_id]
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens
        first_row = len(input_ids)
        input_ids.extend(seq.token_ids_in(start, end - len(item.spec_token_ids)))
        input_ids.extend(item.spec_token_ids)
        positions.extend(range(start, end))
        # A verification chunk (engine.speculative) is described to attention as one query
        # row per position, each seeing the cache up to itself: every row's K/V is stored
        # before any row attends, so this is exact, and a step of decodes and verifications
        # stays on the decode kernels (a decode row's arithmetic, not a prefill's).
        num_queries = item.num_new_tokens if item.spec_token_ids else 1
        for j in range(num_queries):
            context_lens.append(start + j)
            query_lens.append(item.num_new_tokens if num_queries == 1 else 1)
            block_tables.append(seq.block_table)
        if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
            prompt_logprob_spans.append((seq, first_row, start, item.num_new_tokens))
        if seq.pooling is not None:
            pooling_spans.append(PoolingSpan(seq, first_row, start, item.num_new_tokens))
        if seq.lora_id is not None:
            lora_spans.append(RowSpan(seq.lora_id, first_row, item.num_new_tokens))
        if item.spec_token_ids:
            spec_spans.append(SpecSpan(seq, len(input_ids) - len(item.spec_token_ids) - 1,
                                       item.spec_token_ids, item.spec_draft_probs))
        elif item.samples:
            sample_rows.append(len(input_ids) - 1)
            sample_seqs.append(seq)

    inputs = StepInputs(input_ids, positions, context_lens, query_lens, block_tables,
                        scheduled.blocks_to_copy)
    return StepBatch(inputs, sample_rows, sample_seqs, prompt_logprob_spans, pooling_spans,
                  lora_spans, spec_spans)


def rows_of(rows: list[int], logits: torch.Tensor, fallback: Callable[[list[int]], torch.Tensor]
            ) -> Callable[[list[int]], torch.Tensor]:
    """``logits_of`` answering from ``logits`` (the rows ``rows``, computed already) when it can."""
    index = {row: i for i, row in enumerate(rows)}

    def logits_of(wanted: list[int]) -> torch.Tensor:
        if all(row in index for row in wanted):
            return logits[[index[row] for row in wanted]]
        return fallback(wanted)
    return logits_of


def prompt_logprob_records(sampler: Sampler, tokenizer: Any, seq: RunnerSequence,
                           logits_of: Callable[[list[int]], torch.Tensor], first_row: int,
                           start: int, num_new: int) -> list[TokenLogprob]:
    """Records for the prompt tokens a chunk scores. The row of position q scores the token at
    q + 1, so a chunk [start, end) scores prompt tokens start+1 .. end (the last one only if it is
    still a prompt token); position 0 has nothing before it (logprob None)."""
    prompt = seq.prompt_token_ids
    records: list[TokenLogprob] = []
    if start == 0:
        records.append(TokenLogprob(prompt[0], token_text(tokenizer, prompt[0]), None))
    last_q = min(start + num_new, len(prompt) - 1)
    if last_q > start:
        rows = list(range(first_row, first_row + (last_q - start)))
        logprobs = torch.log_softmax(logits_of(rows).float(), dim=-1)
        records.extend(sampler.logprob_records(logprobs, prompt[start + 1:last_q + 1],
                                               seq.params.prompt_logprobs or 0))
    return records
