"""Which stop string ended an output: reported on the finishing chunk (``stop_str``), carried on
the worker's frames, so the Messages API can answer ``stop_sequence`` (its text is cut off, so
nothing else tells it from EOS)."""

from __future__ import annotations

from typing import Any

from llmplatform.model_worker.framing import frames_for
from llmplatform.protocol.worker import WorkerChunk, WorkerParams
from llmplatform.sampling.outputs import FinishReason
from tests.unit.test_output_processor import encode, eos_id, feed, make, tokenizer  # noqa: F401 (fixtures)


def test_the_stop_string_that_matched_is_reported(tokenizer: Any, eos_id: int) -> None:
    processor = make(tokenizer, eos_id, stop=["world", "lo w"])
    chunks = feed(processor, encode(tokenizer, "hello world and more"))
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert chunks[-1].stop_str == "lo w"  # the earliest match, not the first listed
    assert all(c.stop_str is None for c in chunks[:-1])


def test_eos_and_length_report_no_stop_string(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello, world!")
    by_eos = feed(make(tokenizer, eos_id, stop=["zzz"]), [*ids, eos_id])
    assert by_eos[-1].finish_reason is FinishReason.STOP and by_eos[-1].stop_str is None
    by_length = feed(make(tokenizer, eos_id, stop=["zzz"], max_tokens=2), ids)
    assert by_length[-1].finish_reason is FinishReason.LENGTH and by_length[-1].stop_str is None


def test_frames_carry_it_and_leave_it_out_when_unset(tokenizer: Any, eos_id: int) -> None:
    chunks = feed(make(tokenizer, eos_id, stop=["world"]), encode(tokenizer, "hello world"))
    params = WorkerParams(prompt="p", echo=False, stream_deltas=True)
    for streamed in (True, False):  # delta frames and FastChat's cumulative ones
        frames = frames_for(params, "p", streamed=streamed)
        wire = [frames.update(chunk).encode() for chunk in chunks]
        assert b"stop_str" not in wire[0]  # a stock peer sees FastChat's frame, unchanged
        assert WorkerChunk.model_validate_json(wire[-1].rstrip(b"\0")).stop_str == "world"
