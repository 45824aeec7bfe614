"""Cumulative worker chunks -> OpenAI deltas, and FastChat logprobs -> OpenAI's shapes (pure).

A worker's `text` and `logprobs` are cumulative: every chunk carries everything so far. One
:class:`DeltaTracker` per choice remembers how much has been sent and slices off the rest.

Half a UTF-8 character decodes to U+FFFD at the end of the text; it is held back until a later
chunk completes it (or the stream ends), and the logprob entries of tokens that start inside the
held-back tail wait with it, so text and logprobs stay aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmplatform.protocol.openai import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
    Usage,
)
from llmplatform.protocol.worker import ChunkLogprobs, WorkerChunk

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class Delta:
    text: str
    logprobs: ChunkLogprobs | None
    """Only the new entries; None when the worker sends no logprobs."""

    @property
    def has_tokens(self) -> bool:
        return self.logprobs is not None and len(self.logprobs.tokens) > 0


class DeltaTracker:
    """What one choice has sent so far; turns each cumulative chunk into a delta."""

    def __init__(self) -> None:
        self.num_chars_sent = 0
        self.num_tokens_sent = 0

    def advance(self, text: str, logprobs: ChunkLogprobs | None, *, final: bool) -> Delta:
        end = len(text) if final else len(text.rstrip(REPLACEMENT_CHAR))
        delta_text = text[self.num_chars_sent : end] if end > self.num_chars_sent else ""
        self.num_chars_sent = max(self.num_chars_sent, end)
        if logprobs is None:
            return Delta(delta_text, None)
        num_ready = len(logprobs.tokens)
        if not final and len(logprobs.text_offset) == num_ready:
            # Tokens that start inside the held-back tail wait for it.
            num_ready = self.num_tokens_sent
            while num_ready < len(logprobs.tokens) and logprobs.text_offset[num_ready] < end:
                num_ready += 1
        lo, hi = self.num_tokens_sent, max(self.num_tokens_sent, num_ready)
        self.num_tokens_sent = hi
        return Delta(delta_text, slice_logprobs(logprobs, lo, hi))


def slice_logprobs(logprobs: ChunkLogprobs, lo: int, hi: int) -> ChunkLogprobs:
    return ChunkLogprobs(
        text_offset=logprobs.text_offset[lo:hi],
        tokens=logprobs.tokens[lo:hi],
        token_logprobs=logprobs.token_logprobs[lo:hi],
        top_logprobs=logprobs.top_logprobs[lo:hi],
    )


def chat_logprobs(logprobs: ChunkLogprobs | None, num_top: int) -> ChatChoiceLogprobs | None:
    """FastChat's parallel lists as OpenAI chat's `{"content": [per-token objects]}`.

    Entries without a logprob (a prompt's first token) are skipped: chat never echoes the prompt.
    """
    if logprobs is None:
        return None
    content = []
    for i, token in enumerate(logprobs.tokens):
        logprob = logprobs.token_logprobs[i] if i < len(logprobs.token_logprobs) else None
        if logprob is None:
            continue
        top = logprobs.top_logprobs[i] if i < len(logprobs.top_logprobs) else None
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=logprob,
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")))
                    for t, lp in list((top or {}).items())[:num_top]
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(logprobs: ChunkLogprobs | None, num_top: int) -> CompletionLogprobs | None:
    """FastChat's shape is already the legacy completions shape; cap the alternatives."""
    if logprobs is None:
        return None
    return CompletionLogprobs(
        tokens=list(logprobs.tokens),
        token_logprobs=list(logprobs.token_logprobs),
        top_logprobs=[
            None if top is None else dict(list(top.items())[:num_top]) for top in logprobs.top_logprobs
        ],
        text_offset=list(logprobs.text_offset),
    )


def finish_reason(worker_reason: str | None) -> str:
    """OpenAI knows `stop` and `length`; a worker's other reasons (abort, error) read as stop."""
    return "length" if worker_reason == "length" else "stop"


def sum_usage(final_chunks: Sequence[WorkerChunk | None], prompt_tokens: Sequence[int], n: int) -> Usage:
    """Usage over all choices; each prompt's tokens count once, not once per choice (as OpenAI).

    Choices are ordered prompt by prompt, `n` each. The worker's own prompt count wins when it
    reports one (it is what was actually computed); ours is the fallback.
    """
    num_prompt = 0
    for p, counted in enumerate(prompt_tokens):
        first = final_chunks[p * n] if p * n < len(final_chunks) else None
        reported = first.usage.prompt_tokens if first is not None and first.usage is not None else 0
        num_prompt += reported or counted
    num_completion = sum(c.usage.completion_tokens for c in final_chunks if c is not None and c.usage)
    return Usage(
        prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion
    )
