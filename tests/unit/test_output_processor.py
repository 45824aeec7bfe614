"""OutputProcessor and IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE).

The tokenizer splits emoji, CJK and Hebrew characters into several byte tokens, so these tests
see real partial UTF-8, real multi-token stop strings and a real special EOS token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pytest

from llmplatform.sampling.output_processor import IncrementalDetokenizer, OutputProcessor
from llmplatform.sampling.outputs import FinishReason, GenerateChunk, TokenLogprob
from llmplatform.sampling.params import SamplingParams

REPLACEMENT = "\ufffd"
MULTILINGUAL = (
    "Hello, wörld! Grüße 👋🏽 日本語のテキスト 中文 🤖🎉 Ελληνικά русский עברית. "
    "Family: 👨‍👩‍👧, flags 🇯🇵🇫🇷, math ∑∫√ and café naïve. 안녕하세요 세계! "
    "Emoji at the very end 🚀"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def eos_id(tokenizer: Any) -> int:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos == tokenizer.eos_token_id
    return eos


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make(tokenizer: Any, eos_id: int, prompt: str = "Say something:",
         max_total_tokens: int | None = None, **params: Any) -> OutputProcessor:
    return OutputProcessor("req-1", tokenizer, SamplingParams(**params), encode(tokenizer, prompt),
                           (eos_id,), max_total_tokens=max_total_tokens)


def feed(processor: OutputProcessor, token_ids: Sequence[int]) -> list[GenerateChunk]:
    """Appends tokens one at a time, as a decode loop does, until the processor finishes."""
    chunks = []
    for token_id in token_ids:
        chunks.append(processor.append([token_id]))
        if chunks[-1].finish_reason is not None:
            break
    return chunks


def joined(chunks: Sequence[GenerateChunk]) -> str:
    return "".join(c.text for c in chunks)


# ---------------------------------------------------------------------------------------------
# Incremental detokenization


def test_multilingual_deltas_concatenate_to_full_decode(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, MULTILINGUAL)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == MULTILINGUAL
    processor = make(tokenizer, eos_id, max_tokens=len(ids))

    emitted = ""
    held_back_steps = 0
    for i, token_id in enumerate(ids):
        chunk = processor.append([token_id])
        assert REPLACEMENT not in chunk.text
        assert chunk.token_ids == (token_id,)
        emitted += chunk.text
        # Never ahead of the text, never behind it once the bytes so far form whole characters.
        assert expected.startswith(emitted)
        decoded_so_far = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        if decoded_so_far.endswith(REPLACEMENT):
            held_back_steps += 1
            assert len(emitted) < len(decoded_so_far)
        else:
            assert emitted == decoded_so_far
    assert held_back_steps > 10  # the string really does split characters across tokens
    assert chunk.finish_reason is FinishReason.LENGTH
    assert emitted == expected == processor.text
    assert processor.usage.completion_tokens == len(ids)


def test_emoji_split_across_tokens_is_held_back_then_emitted_whole(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hi 👋 there")
    pieces = [tokenizer.decode([t]) for t in ids]
    # ' ' + the first bytes of the emoji, then its remaining byte tokens, then ' there'.
    first_partial = next(i for i, p in enumerate(pieces) if p.endswith(REPLACEMENT))
    last_partial = max(i for i, p in enumerate(pieces) if REPLACEMENT in p)
    assert last_partial > first_partial  # the emoji spans at least two tokens

    processor = make(tokenizer, eos_id)
    deltas = [processor.append([t]).text for t in ids]
    assert "".join(deltas[:first_partial]) == "Hi"
    assert all(d == "" for d in deltas[first_partial:last_partial])
    assert deltas[last_partial] == " 👋"
    assert "".join(deltas) == "Hi 👋 there"


def test_detokenizer_uses_prompt_context_and_flush_drops_incomplete_character(tokenizer: Any) -> None:
    prompt_ids = encode(tokenizer, "Question: what is it?")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    # The prompt is context only: nothing of it is emitted.
    assert detok.push(encode(tokenizer, " Answer")[0]) == " Answer"
    emoji_ids = encode(tokenizer, " 🤖")
    assert len(emoji_ids) > 1
    assert detok.push(emoji_ids[0]) == ""
    assert detok.flush() == " "  # the complete space comes out; the partial emoji bytes do not
    assert detok.flush() == ""


# ---------------------------------------------------------------------------------------------
# EOS and stop token ids


def test_eos_finishes_with_stop_contributes_no_text_but_counts(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello, world!")
    processor = make(tokenizer, eos_id, prompt="Greet:")
    chunks = feed(processor, [*ids, eos_id, *ids])
    assert [c.finish_reason for c in chunks] == [None] * len(ids) + [FinishReason.STOP]
    last = chunks[-1]
    assert last.text == ""
    assert last.token_ids == (eos_id,)
    assert last.usage.completion_tokens == len(ids) + 1
    assert last.usage.prompt_tokens == len(encode(tokenizer, "Greet:"))
    assert joined(chunks) == "Hello, world!" == processor.text


def test_eos_contributes_no_text_even_without_skipping_special_tokens(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello")
    processor = make(tokenizer, eos_id, skip_special_tokens=False)
    chunk = processor.append([*ids, eos_id])
    assert chunk.finish_reason is FinishReason.STOP
    assert chunk.text == "Hello"
    assert chunk.usage.completion_tokens == len(ids) + 1


def test_ignore_eos_keeps_generating_until_max_tokens(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello")
    tail = encode(tokenizer, " again")
    stream = [*ids, eos_id, *tail]
    processor = make(tokenizer, eos_id, ignore_eos=True, max_tokens=len(stream))
    chunks = feed(processor, stream)
    assert len(chunks) == len(stream)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    # The ignored EOS is a special token: skipped in the text but counted as generated.
    assert joined(chunks) == "Hello again"
    assert chunks[-1].usage.completion_tokens == len(stream)


def test_stop_token_ids_finish_without_their_text(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello, world! How are you?")
    bang = encode(tokenizer, "!")[0]
    assert bang in ids
    processor = make(tokenizer, eos_id, stop_token_ids=(bang,))
    chunks = feed(processor, ids)
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert chunks[-1].token_ids == (bang,)
    assert joined(chunks) == "Hello, world"
    assert processor.usage.completion_tokens == ids.index(bang) + 1


# ---------------------------------------------------------------------------------------------
# Stop strings


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tokenizer: Any, eos_id: int) -> None:
    text = "Result: 12 <<END>> trailing text"
    stop = "<<END>>"
    ids = encode(tokenizer, text)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)  # the match really spans several tokens
    processor = make(tokenizer, eos_id, stop=stop)

    emitted = ""
    snapshots = []
    for token_id in ids:
        chunk = processor.append([token_id])
        emitted += chunk.text
        snapshots.append(emitted)
        if chunk.finish_reason is not None:
            break
    assert chunk.finish_reason is FinishReason.STOP
    before = text[:text.index(stop)]
    assert emitted == before == processor.text == "Result: 12 "
    # At no point was any piece of the stop string emitted, not even its first characters.
    for snapshot in snapshots:
        assert before.startswith(snapshot)
        assert len(snapshot) <= len(before)
    # The text before the stop string was not all held back: it streamed as it came.
    assert snapshots[ids.index(encode(tokenizer, "Result")[0])] == "Result"
    assert processor.usage.completion_tokens == len(snapshots)


def test_held_back_partial_match_is_released_when_it_does_not_complete(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "a <<EN and more")  # 'a', ' <<', 'EN', ' and', ' more'
    processor = make(tokenizer, eos_id, stop=["<<END>>"], max_tokens=len(ids))
    deltas = [processor.append([t]).text for t in ids]
    assert deltas[0] == "a"
    assert deltas[1] == " " and deltas[2] == ""  # '<<' then '<<EN' may still become '<<END>>'
    assert deltas[3] == "<<EN and"  # ' and' rules it out: everything comes out
    assert "".join(deltas) == "a <<EN and more"


def test_held_back_prefix_is_emitted_when_the_request_finishes(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "a <<EN")
    processor = make(tokenizer, eos_id, stop=["<<END>>"], max_tokens=len(ids))
    chunks = feed(processor, ids)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert joined(chunks) == "a <<EN"

    processor = make(tokenizer, eos_id, stop=["<<END>>"])
    chunks = feed(processor, [*ids, eos_id])
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert chunks[-1].text == "<<EN"
    assert joined(chunks) == "a <<EN"


def test_earliest_of_several_stop_strings_wins(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "hello world and more")  # 'hello', ' world', ...
    # Both complete with ' world'; 'lo w' starts earlier although it is listed second.
    processor = make(tokenizer, eos_id, stop=["world", "lo w"])
    chunks = feed(processor, ids)
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert len(chunks) == 2
    assert joined(chunks) == "hel" == processor.text


def test_stop_string_in_one_multi_token_append(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "x STOP HERE y and so on")
    processor = make(tokenizer, eos_id, stop=["STOP HERE"])
    chunk = processor.append(ids)
    assert chunk.finish_reason is FinishReason.STOP
    assert chunk.text == "x "
    # Tokens after the one that completed the match are not consumed.
    assert chunk.token_ids == tuple(ids[:ids.index(encode(tokenizer, " HERE")[0]) + 1])


def test_stop_string_completed_by_text_flushed_at_eos_is_cut(tokenizer: Any, eos_id: int) -> None:
    # ' 🤖' -> ' ' + partial emoji bytes: the space is held in the detokenizer until the emoji is
    # complete; EOS flushes it, and that flushed space completes the stop string 'o '.
    ids = encode(tokenizer, "Hello 🤖")
    partial = ids[1]
    assert tokenizer.decode([partial]).startswith(" ") and tokenizer.decode([partial]).endswith(REPLACEMENT)
    processor = make(tokenizer, eos_id, stop=["o "])
    chunks = feed(processor, [ids[0], partial, eos_id])
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert joined(chunks) == "Hell" == processor.text


def test_stop_string_completed_by_text_flushed_at_max_tokens_is_cut(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello 🤖")
    processor = make(tokenizer, eos_id, stop=["o "], max_tokens=2)
    chunks = feed(processor, ids[:2])
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert joined(chunks) == "Hell"


# ---------------------------------------------------------------------------------------------
# Lengths


def test_max_tokens_finishes_with_length(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello, world! How are you today?")
    processor = make(tokenizer, eos_id, max_tokens=3)
    chunk = processor.append(ids)
    assert chunk.finish_reason is FinishReason.LENGTH
    assert chunk.token_ids == tuple(ids[:3])
    assert chunk.text == "Hello, world"
    assert chunk.usage.completion_tokens == 3


def test_context_length_caps_max_tokens(tokenizer: Any, eos_id: int) -> None:
    prompt = "Say something:"
    num_prompt = len(encode(tokenizer, prompt))
    processor = make(tokenizer, eos_id, prompt=prompt, max_tokens=100,
                     max_total_tokens=num_prompt + 2)
    chunks = feed(processor, encode(tokenizer, "Hello, world! How are you today?"))
    assert len(chunks) == 2
    assert chunks[-1].finish_reason is FinishReason.LENGTH


def test_tokens_after_the_finishing_one_are_ignored(tokenizer: Any, eos_id: int) -> None:
    hello = encode(tokenizer, "Hello")
    world = encode(tokenizer, " world")
    logprobs = [TokenLogprob(t, tokenizer.decode([t]), -0.5) for t in [*hello, eos_id, *world]]
    processor = make(tokenizer, eos_id, logprobs=0)
    chunk = processor.append([*hello, eos_id, *world], logprobs)
    assert chunk.token_ids == (*hello, eos_id)
    assert chunk.logprobs == tuple(logprobs[:len(hello) + 1])
    assert chunk.text == "Hello"
    assert chunk.usage.completion_tokens == len(hello) + 1
    assert processor.output_ids == [*hello, eos_id]
    # Once finished, later appends consume nothing.
    again = processor.append(world)
    assert again.token_ids == () and again.text == "" and again.finish_reason is FinishReason.STOP
    assert again.usage.completion_tokens == len(hello) + 1


def test_logprobs_are_dropped_when_not_requested(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello")
    processor = make(tokenizer, eos_id)
    chunk = processor.append(ids, [TokenLogprob(t, "x", -1.0) for t in ids])
    assert chunk.logprobs is None


# ---------------------------------------------------------------------------------------------
# min_tokens


def test_min_tokens_defers_eos_and_stop_token_ids(tokenizer: Any, eos_id: int) -> None:
    hello = encode(tokenizer, "Hello")[0]
    comma = encode(tokenizer, ",")[0]
    processor = make(tokenizer, eos_id, min_tokens=3, stop_token_ids=(comma,))
    # Tokens 1-3 may not stop (the sampler masks them; here they arrive anyway).
    for token_id in (eos_id, comma, hello):
        assert processor.append([token_id]).finish_reason is None
    chunk = processor.append([eos_id])  # the 4th token may
    assert chunk.finish_reason is FinishReason.STOP
    assert chunk.usage.completion_tokens == 4
    assert processor.text == ",Hello"


def test_min_tokens_defers_stop_strings(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello, world! How are you today?")  # 'Hello' ',' ' world' '!' ...
    processor = make(tokenizer, eos_id, min_tokens=3, stop=["!", ","])
    chunks = feed(processor, ids)
    # ',' arrives as token 2 (< min_tokens): kept. '!' arrives as token 4: stops.
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert len(chunks) == 4
    assert joined(chunks) == "Hello, world"


def test_stop_string_completed_exactly_at_min_tokens_stops(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello, world! How are you today?")
    processor = make(tokenizer, eos_id, min_tokens=2, stop=[","])
    chunks = feed(processor, ids)
    assert len(chunks) == 2 and chunks[-1].finish_reason is FinishReason.STOP
    assert joined(chunks) == "Hello"


def test_stop_string_completed_before_min_tokens_does_not_stop_later(tokenizer: Any, eos_id: int) -> None:
    # ',' completes as token 2, before min_tokens allows stopping; a longer stop string in the
    # list must not make a later check look back far enough to match it after the fact.
    ids = encode(tokenizer, "Hello, world! How are you today?")
    processor = make(tokenizer, eos_id, min_tokens=3, stop=[",", "a long stop string"],
                     max_tokens=len(ids))
    chunks = feed(processor, ids)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert joined(chunks) == "Hello, world! How are you today?" == processor.text


# ---------------------------------------------------------------------------------------------
# finish() from outside


def test_finish_abort_emits_complete_text_including_held_back(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "a <<EN")
    processor = make(tokenizer, eos_id, stop=["<<END>>"])
    emitted = joined(feed(processor, ids))
    assert emitted == "a "
    chunk = processor.finish(FinishReason.ABORT)
    assert chunk.finish_reason is FinishReason.ABORT
    assert chunk.token_ids == ()
    assert emitted + chunk.text == "a <<EN"
    assert chunk.usage.completion_tokens == len(ids)
    # Finishing twice changes nothing and emits nothing more.
    again = processor.finish(FinishReason.ERROR, error="late")
    assert again.finish_reason is FinishReason.ABORT and again.text == ""


def test_finish_abort_mid_character_emits_whole_characters_only(tokenizer: Any, eos_id: int) -> None:
    ids = encode(tokenizer, "Hello 🤖")
    processor = make(tokenizer, eos_id)
    emitted = joined(feed(processor, ids[:2]))  # 'Hello', ' ' + partial emoji bytes
    assert emitted == "Hello"
    chunk = processor.finish(FinishReason.ABORT)
    assert REPLACEMENT not in chunk.text
    assert emitted + chunk.text == "Hello "
    assert chunk.usage.completion_tokens == 2


def test_finish_after_natural_stop_keeps_the_reason(tokenizer: Any, eos_id: int) -> None:
    processor = make(tokenizer, eos_id)
    processor.append([*encode(tokenizer, "Hi"), eos_id])
    chunk = processor.finish(FinishReason.ABORT)
    assert chunk.finish_reason is FinishReason.STOP
    assert chunk.text == ""


def test_finish_error_carries_the_message(tokenizer: Any, eos_id: int) -> None:
    processor = make(tokenizer, eos_id)
    processor.append(encode(tokenizer, "Hi"))
    chunk = processor.finish(FinishReason.ERROR, error="boom")
    assert chunk.finish_reason is FinishReason.ERROR and chunk.error == "boom"
    assert str(chunk.finish_reason) == "error"
