"""Worker chunks -> OpenAI deltas, and FastChat logprobs -> OpenAI's shapes (pure).

The chunks are delta frames (each carries only the text and logprob entries that are new): our
workers send them, and a stock worker's cumulative frames are made into them on the way in
(:mod:`.fastchat_peer`). One :class:`DeltaTracker` per choice passes each on; :class:`FinalChunk`
rebuilds a choice's whole result (every delta joined once, at the end), so a long stream costs
the gateway the same per token throughout.

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
    """What one choice has sent so far; turns each delta chunk into what the client gets."""

    def __init__(self) -> None:
        self.num_chars_sent = 0
        self.num_tokens_sent = 0
        # What arrived but waits (a split UTF-8 character and its tokens' entries).
        self._held_text = ""
        self._held_logprobs: ChunkLogprobs | None = None

    def take(self, chunk: WorkerChunk, *, want_logprobs: bool) -> Delta:
        """The delta `chunk` adds (its logprobs only when `want_logprobs`)."""
        assert chunk.delta, "cumulative frames are made deltas on the way in (fastchat_peer)"
        logprobs = chunk.logprobs if want_logprobs else None
        final = chunk.finish_reason is not None
        pending = self._held_text + chunk.text if self._held_text else chunk.text
        ready = len(pending) if final else len(pending.rstrip(REPLACEMENT_CHAR))
        delta_text, self._held_text = pending[:ready], pending[ready:]
        self.num_chars_sent += ready  # text_offset counts in the whole text, as this does
        if logprobs is None:
            return Delta(delta_text, None)
        if self._held_logprobs is not None:
            logprobs = join_logprobs([self._held_logprobs, logprobs])
            self._held_logprobs = None
        num_ready = len(logprobs.tokens)
        if not final and len(logprobs.text_offset) == num_ready:
            num_ready = 0  # tokens starting in the held-back tail wait
            while num_ready < len(logprobs.tokens) and logprobs.text_offset[num_ready] < self.num_chars_sent:
                num_ready += 1
        if num_ready < len(logprobs.tokens):
            self._held_logprobs = slice_logprobs(logprobs, num_ready, len(logprobs.tokens))
            logprobs = slice_logprobs(logprobs, 0, num_ready)
        self.num_tokens_sent += num_ready
        return Delta(delta_text, logprobs)


def slice_logprobs(logprobs: ChunkLogprobs, lo: int, hi: int) -> ChunkLogprobs:
    return ChunkLogprobs(
        text_offset=logprobs.text_offset[lo:hi],
        tokens=logprobs.tokens[lo:hi],
        token_logprobs=logprobs.token_logprobs[lo:hi],
        top_logprobs=logprobs.top_logprobs[lo:hi],
    )


def join_logprobs(parts: Sequence[ChunkLogprobs]) -> ChunkLogprobs:
    """Consecutive logprob entries as one (their text offsets are already absolute)."""
    joined = ChunkLogprobs()
    for part in parts:
        joined.text_offset.extend(part.text_offset)
        joined.tokens.extend(part.tokens)
        joined.token_logprobs.extend(part.token_logprobs)
        joined.top_logprobs.extend(part.top_logprobs)
    return joined


class FinalChunk:
    """One choice's whole result, from its delta chunks as they come: kept, and joined once,
    when :meth:`result` is asked for."""

    def __init__(self) -> None:
        self._last: WorkerChunk | None = None
        self._texts: list[str] = []
        self._logprobs: list[ChunkLogprobs] = []

    def add(self, chunk: WorkerChunk) -> None:
        assert chunk.delta, "cumulative frames are made deltas on the way in (fastchat_peer)"
        self._texts.append(chunk.text)
        if chunk.logprobs is not None:
            self._logprobs.append(chunk.logprobs)
        self._last = chunk

    @property
    def last(self) -> WorkerChunk | None:
        return self._last

    def result(self) -> WorkerChunk | None:
        """The cumulative chunk the choice's chunks add up to (its last one's usage and reason)."""
        last = self._last
        if last is None:
            return None
        logprobs = join_logprobs(self._logprobs) if last.logprobs is not None or self._logprobs else None
        return last.model_copy(update={"text": "".join(self._texts), "logprobs": logprobs, "delta": False})


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
