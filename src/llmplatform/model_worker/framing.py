"""The backend's chunks as the worker's stream frames: FastChat's cumulative ones, or deltas.

The backend yields deltas (:class:`GenerateChunk`: the new text, the new logprob records). A stock
FastChat peer expects every frame to carry everything so far: the whole text and every logprob
entry (:class:`CumulativeFrames`). That makes a stream quadratic in its length for both ends (each
frame is serialised, sent and parsed whole; with ``top_logprobs`` 20 alternatives per token ride
along every time), so a peer that asks for it (``stream_deltas``, our addition: our gateway does)
gets :class:`DeltaFrames` instead, each carrying only what is new and marked ``delta``.

In both, ``logprobs.text_offset`` counts from the start of the whole text: a delta frame's entries
line up with the concatenation of every frame's text, as a cumulative frame's do with its own.
``usage`` and ``finish_reason`` are the same in both (they are small, and the last frame's are
the request's).
"""

from __future__ import annotations

from llmplatform.llm.base import GenerateChunk
from llmplatform.protocol.worker import ChunkLogprobs, ChunkUsage, WorkerChunk, WorkerParams


class _Frames:
    def __init__(self, params: WorkerParams, prompt: str) -> None:
        self._echo_prompt = prompt if params.echo else ""
        self._want_logprobs = params.logprobs is not None
        self._offset = 0

    def _logprobs_of(self, chunk: GenerateChunk, into: ChunkLogprobs) -> None:
        for record in (*(chunk.prompt_logprobs or ()), *(chunk.logprobs or ())):
            # The first prompt token has no logprob (None) and no alternatives.
            top = {t.token: t.logprob for t in record.top} if record.logprob is not None else None
            into.text_offset.append(self._offset)
            into.tokens.append(record.token)
            into.token_logprobs.append(record.logprob)
            into.top_logprobs.append(top)
            self._offset += len(record.token)

    @staticmethod
    def _usage(chunk: GenerateChunk) -> ChunkUsage:
        usage = chunk.usage
        return ChunkUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                          total_tokens=usage.total_tokens)

    @staticmethod
    def _finish_reason(chunk: GenerateChunk) -> str | None:
        return chunk.finish_reason.value if chunk.finish_reason else None


class CumulativeFrames(_Frames):
    """FastChat's frames: all text and every logprob entry so far, in each one."""

    def __init__(self, params: WorkerParams, prompt: str) -> None:
        super().__init__(params, prompt)
        self._text = self._echo_prompt
        self._logprobs = ChunkLogprobs() if self._want_logprobs else None

    def update(self, chunk: GenerateChunk) -> WorkerChunk:
        if self._logprobs is not None:
            self._logprobs_of(chunk, self._logprobs)
        self._text += chunk.text
        return WorkerChunk(
            text=self._text, error_code=0, usage=self._usage(chunk), finish_reason=self._finish_reason(chunk),
            logprobs=self._logprobs.model_copy(deep=True) if self._logprobs is not None else None,
            index=chunk.index, stop_str=chunk.stop_str)


class DeltaFrames(_Frames):
    """Our frames (``stream_deltas``): only what is new since the previous frame; the first one
    also carries the echoed prompt, when ``echo`` asks for it."""

    def __init__(self, params: WorkerParams, prompt: str) -> None:
        super().__init__(params, prompt)
        self._pending_echo = self._echo_prompt

    def update(self, chunk: GenerateChunk) -> WorkerChunk:
        logprobs = None
        if self._want_logprobs:
            logprobs = ChunkLogprobs()
            self._logprobs_of(chunk, logprobs)
        text, self._pending_echo = self._pending_echo + chunk.text, ""
        return WorkerChunk(text=text, error_code=0, usage=self._usage(chunk),
                           finish_reason=self._finish_reason(chunk), logprobs=logprobs, delta=True,
                           index=chunk.index, stop_str=chunk.stop_str)


def frames_for(params: WorkerParams, prompt: str, *, streamed: bool) -> CumulativeFrames | DeltaFrames:
    """Delta frames for a stream whose peer asked for them; cumulative ones otherwise (and always
    for ``/worker_generate``, whose one answer is the last frame: the whole result)."""
    if streamed and params.stream_deltas:
        return DeltaFrames(params, prompt)
    return CumulativeFrames(params, prompt)
