"""The gateway's pure response side: deltas from cumulative worker text, logprobs' shapes,
finish reasons and usage, NUL framing, and how worker and HTTP errors map to OpenAI's envelope."""

from __future__ import annotations

import json

import pytest

from llmplatform.errors import (
    ContextLengthExceededError,
    EngineOverloadedError,
    ErrorCode,
    InvalidRequestError,
    LLMPlatformError,
    ModelNotFoundError,
    NoWorkerError,
)
from llmplatform.openai_api.deltas import (
    DeltaTracker,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    sum_usage,
)
from llmplatform.openai_api.fastchat_peer import CumulativeFrames
from llmplatform.openai_api.errors import AuthenticationError, UpstreamError, error_from_http, error_payload
from llmplatform.openai_api.worker_wire import NulFrameDecoder, parse_chunk
from llmplatform.protocol.worker import ChunkLogprobs, ChunkUsage, WorkerChunk


# ---- deltas --------------------------------------------------------------------------------------


class _Cumulative:
    """A stock worker's cumulative frames as the main path takes them: made deltas by the
    FastChat-peer adapter, then passed on by a choice's tracker."""

    def __init__(self) -> None:
        self.frames = CumulativeFrames()
        self.tracker = DeltaTracker()

    def advance(self, text: str, logprobs: ChunkLogprobs | None, *, final: bool):
        chunk = WorkerChunk(text=text, logprobs=logprobs, finish_reason="stop" if final else None)
        return self.tracker.take(self.frames.delta(chunk), want_logprobs=True)


def test_deltas_from_cumulative_text() -> None:
    tracker = _Cumulative()
    assert tracker.advance("Hel", None, final=False).text == "Hel"
    assert tracker.advance("Hello", None, final=False).text == "lo"
    assert tracker.advance("Hello", None, final=False).text == ""
    assert tracker.advance("Hello!", None, final=True).text == "!"


def test_replacement_char_held_back() -> None:
    tracker = _Cumulative()
    assert tracker.advance("caf\ufffd", None, final=False).text == "caf"
    assert tracker.advance("caf\ufffd\ufffd", None, final=False).text == ""
    assert tracker.advance("café", None, final=False).text == "é"
    # At the end a genuine U+FFFD is sent: nothing more will complete it.
    assert tracker.advance("café\ufffd", None, final=True).text == "\ufffd"


def _lp(tokens: list[str], offsets: list[int]) -> ChunkLogprobs:
    return ChunkLogprobs(
        text_offset=offsets,
        tokens=tokens,
        token_logprobs=[-0.5] * len(tokens),
        top_logprobs=[{t: -0.5, "zz": -2.0} for t in tokens],
    )


def test_logprob_slicing_follows_text() -> None:
    tracker = _Cumulative()
    d1 = tracker.advance("ab", _lp(["a", "b"], [0, 1]), final=False)
    assert d1.text == "ab" and d1.logprobs.tokens == ["a", "b"]
    # The third token is half a character: held back with its text.
    d2 = tracker.advance("ab\ufffd", _lp(["a", "b", "\ufffd"], [0, 1, 2]), final=False)
    assert d2.text == "" and d2.logprobs.tokens == [] and not d2.has_tokens
    d3 = tracker.advance("abé", _lp(["a", "b", "\ufffd", "é"], [0, 1, 2, 2]), final=False)
    assert d3.text == "é" and d3.logprobs.tokens == ["\ufffd", "é"]
    d4 = tracker.advance("abé", _lp(["a", "b", "\ufffd", "é"], [0, 1, 2, 2]), final=True)
    assert d4.text == "" and d4.logprobs.tokens == []


def test_chat_logprobs_shape() -> None:
    lp = ChunkLogprobs(
        text_offset=[0, 1], tokens=["P", "é"], token_logprobs=[None, -0.25], top_logprobs=[None, {"é": -0.25, "e": -1.5}]
    )
    out = chat_logprobs(lp, num_top=1)
    assert out is not None and out.content is not None
    assert len(out.content) == 1  # the entry without a logprob (a prompt token) is skipped
    entry = out.content[0]
    assert entry.token == "é" and entry.logprob == -0.25 and entry.bytes == [0xC3, 0xA9]
    assert [t.token for t in entry.top_logprobs] == ["é"]
    assert chat_logprobs(None, 2) is None


def test_completion_logprobs_shape() -> None:
    lp = _lp(["a", "b"], [0, 1])
    out = completion_logprobs(lp, num_top=1)
    assert out.tokens == ["a", "b"] and out.text_offset == [0, 1]
    assert out.top_logprobs == [{"a": -0.5}, {"b": -0.5}]


def test_finish_reason_and_usage() -> None:
    assert finish_reason("length") == "length"
    assert finish_reason("stop") == finish_reason("abort") == finish_reason(None) == "stop"
    chunks = [
        WorkerChunk(text="x", usage=ChunkUsage(prompt_tokens=5, completion_tokens=2), finish_reason="stop"),
        WorkerChunk(text="y", usage=ChunkUsage(prompt_tokens=5, completion_tokens=3), finish_reason="stop"),
        WorkerChunk(text="z", usage=None, finish_reason="stop"),
        WorkerChunk(text="w", usage=ChunkUsage(prompt_tokens=0, completion_tokens=1), finish_reason="length"),
    ]
    usage = sum_usage(chunks, [5, 7], n=2)  # 2 prompts x 2 choices; prompt 2's worker count missing
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 6, 18)


# ---- framing and errors --------------------------------------------------------------------------


def test_nul_framing_across_reads() -> None:
    frames = [json.dumps({"text": t, "error_code": 0}).encode() + b"\0" for t in ("a", "ab", "abc")]
    stream = b"".join(frames)
    for cut in range(1, len(stream)):
        decoder = NulFrameDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [parse_chunk(f).text for f in got] == ["a", "ab", "abc"]
        assert decoder.flush() is None
    decoder = NulFrameDecoder()
    assert decoder.feed(b'{"text": "x"}\0{"text": "xy"') == [b'{"text": "x"}']
    assert decoder.flush() == b'{"text": "xy"'


def test_error_chunks_map_to_typed_errors() -> None:
    cases = {
        ErrorCode.CONTEXT_OVERFLOW: (ContextLengthExceededError, 400),
        ErrorCode.PARAM_OUT_OF_RANGE: (InvalidRequestError, 400),
        ErrorCode.INVALID_MODEL: (ModelNotFoundError, 404),
        ErrorCode.ENGINE_OVERLOADED: (EngineOverloadedError, 429),
        ErrorCode.CONTROLLER_NO_WORKER: (NoWorkerError, 503),
        ErrorCode.INTERNAL_ERROR: (LLMPlatformError, 500),
    }
    for code, (cls, status) in cases.items():
        with pytest.raises(cls) as info:
            parse_chunk(json.dumps({"text": "boom", "error_code": code}).encode())
        assert info.value.http_status == status and info.value.message == "boom"
    with pytest.raises(UpstreamError):
        parse_chunk(b"not json")
    # Our addition: the field the worker refused, kept for the error envelope's `param`.
    with pytest.raises(InvalidRequestError) as info:
        parse_chunk(json.dumps({"text": "no such token", "error_code": 40302, "param": "logit_bias"}).encode())
    assert info.value.param == "logit_bias"


def test_error_from_http() -> None:
    err = error_from_http(400, json.dumps({"text": "too long", "error_code": 40303}).encode(), "w")
    assert isinstance(err, ContextLengthExceededError)
    assert isinstance(error_from_http(422, b'{"detail": "x"}', "w"), InvalidRequestError)
    assert error_from_http(500, b"oops", "w").http_status == 502


def test_error_envelope() -> None:
    payload = error_payload(ContextLengthExceededError("too long", param="messages"))
    assert payload == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    auth = error_payload(AuthenticationError("no key"))["error"]
    assert (auth["type"], auth["code"]) == ("invalid_request_error", "invalid_api_key")
    assert AuthenticationError("x").http_status == 401
