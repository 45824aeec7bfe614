"""What a generation yields, chunk by chunk: the result types the engine and every backend share.

A generation is a stream of :class:`GenerateChunk` objects, each carrying the *delta* since the
previous chunk (new token ids, new visible text, their log-probabilities) plus running usage;
exactly the last chunk has a ``finish_reason``. Contracts only, no logic: the engine builds them
(through :mod:`llmplatform.sampling.output_processor`), backends pass them on, the worker turns
them into its wire format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the context length reached
    ABORT = "abort"      # cancelled by the client
    ERROR = "error"      # the backend failed

    def __str__(self) -> str:  # so f-strings and JSON see "stop", not "FinishReason.STOP"
        return self.value


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one chosen token and its top alternatives (most likely first).

    ``logprob`` is None only for the first prompt token (nothing precedes it)."""

    token_id: int
    token: str
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerateChunk:
    """What one step added to a request's output (deltas, not cumulative values)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    usage: Usage
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    # On the finishing chunk of an output a stop string ended: which one (its text is cut off,
    # so only this tells it from EOS; Anthropic's Messages API reports it as `stop_sequence`).
    stop_str: str | None = None
    # Only on the first chunk, and only when SamplingParams.prompt_logprobs is set; one record per
    # prompt token.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # Only on a chunk with finish_reason ERROR: the message, and its FastChat error code when
    # the request itself is at fault (None: the backend's fault, an internal error).
    error: str | None = None
    error_code: int | None = None
    # time.monotonic() at which the backend first scheduled the request (left its own waiting
    # queue), on the request's first chunk only; None when the backend does not report it.
    first_scheduled_time: float | None = None
    # Which of the request's ``SamplingParams.n`` outputs this chunk belongs to.
    index: int = 0
