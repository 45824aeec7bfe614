"""Turning sampled token ids into the visible output: done once here, for every backend.

Per request, :class:`OutputProcessor` owns
- incremental detokenization that never splits a UTF-8 character (a token that ends mid-character
  decodes to U+FFFD; its text is held back until the next token completes it),
- stop conditions: EOS (unless ``ignore_eos``), stop token ids, stop strings, ``max_tokens``,
  and, for a constrained output, its grammar's end (the stop token that completes it ends the
  output whatever ``ignore_eos`` and ``min_tokens`` say: nothing may follow it),
- stop-string hold-back: text that might be the beginning of a stop string is not emitted until
  it is known not to be, and a matched stop string is never emitted.

Backends call :meth:`OutputProcessor.append` with each step's new token ids and get back the
:class:`GenerateChunk` to yield; they stop when the chunk has a ``finish_reason``.

The decisions that need only token ids (EOS and stop token ids, ``max_tokens`` and the context
length, a grammar's end) are :class:`TokenStops`'; the text's (stop strings) are the processor's.
``append`` runs both, one after the other. The native engine runs them apart (engine.output_pipeline):
``TokenStops.accept`` on the step thread, so the scheduler frees a stopped sequence before the next
step, and :meth:`OutputProcessor.emit` (detokenizing, stop strings, the chunk) overlapped with the
next step. Both orders give the same chunks: ``append`` is ``emit(accept(...))``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from llmplatform.sampling.outputs import FinishReason, GenerateChunk, TokenLogprob, Usage
from llmplatform.sampling.params import SamplingParams

if TYPE_CHECKING:
    from llmplatform.sampling.grammar_matcher import SequenceGrammar

_REPLACEMENT = "\ufffd"
# Prompt tokens kept in front of the output when decoding, so that tokenizers that drop a leading
# space at the start of a sequence (SentencePiece) still render the first output word correctly.
_PREFIX_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Decodes a growing token sequence into text deltas without splitting characters.

    Keeps two offsets into ``ids``: text up to ``read_offset`` has been emitted; decoding starts at
    ``prefix_offset`` so the tokenizer sees some context (merges and spaces depend on it).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_PREFIX_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the newly completed text (may be empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end is dropped)."""
        prefix_text = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full_text[len(prefix_text):].rstrip(_REPLACEMENT)


def eos_token_ids_of(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """Every token id that ends a generation for this model: the tokenizer's EOS and the
    generation config's (which may list several, e.g. Llama 3's <|eot_id|>)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(t) for t in gen_eos)
    return tuple(sorted(ids))


def token_text(tokenizer: Any, token_id: int) -> str:
    """A single token's text as OpenAI's logprobs show it."""
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class TokenStops:
    """The finishing rules that need token ids only: a stop token (EOS unless ``ignore_eos``,
    ``stop_token_ids``; both only past ``min_tokens``), a constrained output's grammar ending,
    and ``max_tokens`` capped by the context length. Cheap, so it can run on the step thread."""

    def __init__(self, params: SamplingParams, num_prompt_tokens: int,
                 eos_token_ids: Iterable[int], max_total_tokens: int | None = None,
                 grammar: SequenceGrammar | None = None) -> None:
        self._grammar = grammar
        self._min_tokens = params.min_tokens
        self._stop_ids = frozenset(() if params.ignore_eos else eos_token_ids) | frozenset(
            params.stop_token_ids)
        # max_tokens, further capped by the context length when the backend gives one.
        self.max_output = params.max_tokens
        if max_total_tokens is not None:
            self.max_output = max(0, min(self.max_output, max_total_tokens - num_prompt_tokens))
        self.num_output = 0
        self.finish_reason: FinishReason | None = None

    def accept(self, token_ids: Sequence[int]) -> tuple[int, FinishReason | None]:
        """Counts newly sampled tokens up to the first that finishes the output; returns how many
        count (the rest are dropped) and the finish reason (None: not finished). ``LENGTH`` is
        provisional: a stop string the last token's text completes still makes it ``STOP``."""
        for i, token_id in enumerate(token_ids):
            if self.finish_reason is not None:
                return i, self.finish_reason
            self.num_output += 1
            if ((self.num_output > self._min_tokens and token_id in self._stop_ids)
                    or (self._grammar is not None and self._grammar.is_terminated())):
                self.finish_reason = FinishReason.STOP
            elif self.num_output >= self.max_output:
                self.finish_reason = FinishReason.LENGTH
        return len(token_ids), self.finish_reason


class OutputProcessor:
    """Tracks one request's output and decides when it finishes."""

    def __init__(self, request_id: str, tokenizer: Any, params: SamplingParams,
                 prompt_token_ids: Sequence[int], eos_token_ids: Iterable[int],
                 max_total_tokens: int | None = None, grammar: SequenceGrammar | None = None):
        """``grammar``: the output's constraint, advanced by the sampler before each token gets
        here (read only, to end the output where the grammar ends)."""
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        # The token-id rules, for ``append``; the engine runs its own copy apart (module docstring).
        self.token_stops = TokenStops(params, self.num_prompt_tokens, eos_token_ids,
                                      max_total_tokens, grammar)
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.stop_str: str | None = None  # the stop string that finished the output, if one did
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._text = ""      # all decoded output text (a matched stop string is cut off)
        self._sent = 0       # how much of _text has been emitted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, len(self.output_ids))

    @property
    def text(self) -> str:
        return self._text

    def append(self, token_ids: Sequence[int],
               logprobs: Sequence[TokenLogprob] | None = None) -> GenerateChunk:
        """Consumes newly sampled tokens; tokens after a finishing one are ignored."""
        if self.finished:
            return self.emit((), None, None)
        num_kept, reason = self.token_stops.accept(token_ids)
        return self.emit(token_ids[:num_kept], logprobs, reason)

    def emit(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None,
             token_finish: FinishReason | None) -> GenerateChunk:
        """The chunk of tokens :class:`TokenStops` accepted already, ``token_finish`` its verdict
        on the last of them. Detokenizes them and applies the stop strings, which may end the
        output earlier: then the tokens after the one completing the stop string are ignored
        (neither emitted nor counted in usage)."""
        accepted: list[int] = []
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            if self.finished:
                break
            accepted.append(token_id)
            self._push(token_id, token_finish if i == last else None)
        chunk_logprobs = None
        if logprobs is not None and self.params.logprobs is not None:
            chunk_logprobs = tuple(logprobs[:len(accepted)])
        return GenerateChunk(
            request_id=self.request_id,
            text=self._take_text(),
            token_ids=tuple(accepted),
            usage=self.usage,
            finish_reason=self.finish_reason,
            logprobs=chunk_logprobs,
            stop_str=self.stop_str,
        )

    def finish(self, reason: FinishReason, error: str | None = None) -> GenerateChunk:
        """Ends the request from outside (abort, error); emits whatever text is complete."""
        if not self.finished:
            self._add_text(self._detok.flush())
            self.finish_reason = reason
        return GenerateChunk(request_id=self.request_id, text=self._take_text(), token_ids=(),
                             usage=self.usage, finish_reason=self.finish_reason, error=error)

    def _push(self, token_id: int, token_finish: FinishReason | None) -> None:
        self.output_ids.append(token_id)
        if token_finish is FinishReason.STOP:
            # The stop token itself counts as generated but contributes no text.
            self.finish_reason = FinishReason.STOP
            self._add_text(self._detok.flush())
            return
        self._add_text(self._detok.push(token_id))
        if not self.finished and token_finish is FinishReason.LENGTH:
            self.finish_reason = FinishReason.LENGTH
            self._add_text(self._detok.flush())  # a stop string this completes still wins

    def _add_text(self, text: str) -> None:
        """Appends decoded text, cutting at a stop string it completes (once min_tokens allows)."""
        previous_len = len(self._text)
        self._text += text
        if text and self.params.stop and len(self.output_ids) >= self.params.min_tokens:
            self._check_stop_strings(previous_len)

    def _check_stop_strings(self, previous_len: int) -> None:
        # Only a match ending in the new text is new: one ending earlier was either ruled out
        # already or came before min_tokens allowed stopping, and must not stop the request now.
        best: int | None = None
        for stop in self.params.stop:
            pos = self._text.find(stop, max(0, previous_len - len(stop) + 1))
            if pos != -1 and (best is None or pos < best):
                best, self.stop_str = pos, stop
        if best is not None:
            self._text = self._text[:best]
            self.finish_reason = FinishReason.STOP

    def _take_text(self) -> str:
        end = len(self._text)
        if not self.finished and self.params.stop:
            end -= self._held_back_len()
        end = max(end, self._sent)
        delta = self._text[self._sent:end]
        self._sent = end
        return delta

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        longest = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
