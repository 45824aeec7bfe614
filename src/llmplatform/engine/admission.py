"""What the engine checks before it takes a request, and what it records after each step.

``check_generate`` and ``check_pooling`` are the engine's admission rules (``LLMEngine.validate``,
``validate_pooling``): a request that can never be served is refused before anything is
allocated, with the error type and parameter the gateway turns into a 400. ``record_step`` adds a
step to the engine's counters (``StepStats``) and logs its preemptions and prefix deferrals.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from llmplatform.engine.outputs import SchedulerOutput, StepStats
from llmplatform.engine.sequence import Sequence
from llmplatform.errors import ContextLengthExceededError, InvalidRequestError
from llmplatform.sampling.params import SamplingParams, check_prompt_token_ids
from llmplatform.utils.logs import request_context

logger = logging.getLogger("llmplatform.engine")


def check_generate(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int,
                   max_model_len: int, max_num_seqs: int) -> None:
    """Raises for a generation request that can never be served: an empty prompt, a token id
    outside the vocabulary (the logits' width: ``vocab_size``) in the prompt or the parameters,
    more than ``max_model_len`` tokens with ``max_tokens``, or more outputs than ``max_num_seqs``."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    check_prompt_token_ids(prompt_token_ids, vocab_size)
    params.check_vocab(vocab_size)
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {total} tokens ({len(prompt_token_ids)} in the prompt, "
            f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens")
    if params.n > max_num_seqs:
        raise InvalidRequestError(f"n={params.n} exceeds --max-num-seqs {max_num_seqs}", param="n")


def check_pooling(prompt_token_ids: list[int], *, vocab_size: int, max_model_len: int) -> None:
    """Raises for a pooling request that can never be served: empty, a token id outside the
    vocabulary, or longer than ``max_model_len``."""
    if not prompt_token_ids:
        raise InvalidRequestError("the input is empty", param="input")
    check_prompt_token_ids(prompt_token_ids, vocab_size)
    if len(prompt_token_ids) > max_model_len:
        raise ContextLengthExceededError(
            f"the input has {len(prompt_token_ids)} tokens, more than this model's maximum "
            f"of {max_model_len}", param="input")


def record_step(stats: StepStats, scheduled: SchedulerOutput, seqs: Mapping[int, Sequence],
                running: Seq[Sequence], block_size: int) -> None:
    """Counts a step that ran (``seqs``: the engine's sequences by id; ``running``: the
    scheduler's running sequences after it) and logs, per request, who was preempted or deferred."""
    stats.num_steps += 1
    stats.num_preemptions += len(scheduled.preempted)
    for seq_id in scheduled.preempted:
        seq = seqs[seq_id]
        with request_context(seq.request_id):
            logger.debug("preempted output %d at %d tokens (KV cache full); it will be "
                         "recomputed", seq.index, seq.num_tokens)
    # A deferral waits for blocks a scheduled sequence computes, so no step that defers is
    # empty (empty steps are not recorded).
    stats.num_deferred_for_prefix += len(scheduled.deferred)
    stats.num_computed_prompt_tokens += scheduled.num_prompt_tokens
    for seq_id, num_blocks in scheduled.deferred:
        seq = seqs[seq_id]
        with request_context(seq.request_id):
            logger.debug("output %d waits for %d prompt blocks another request is computing "
                         "now (a shared prefix); it reuses them once cached", seq.index, num_blocks)
    stats.num_batched_tokens += scheduled.num_batched_tokens
    slots = sum(len(s.block_table) for s in running) * block_size
    stored = sum(s.num_computed_tokens for s in running)
    if slots:
        stats.kv_efficiency_sum += stored / slots
