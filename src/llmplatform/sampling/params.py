"""Sampling parameters: one validated type shared by every backend.

Validation happens at construction, so a backend never sees an out-of-range value; each failure is
an :class:`InvalidRequestError` naming the offending parameter (it becomes a 400 at the edge).
What depends on the model (token ids against its vocabulary) is checked by :meth:`SamplingParams.
check_vocab` and :func:`check_prompt_token_ids`, which every backend runs before a request reaches a
forward pass or the sampler (an id outside the logits would be an IndexError in the sampler).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmplatform.errors import InvalidRequestError

# Temperatures below this are treated as greedy decoding (FastChat's convention).
GREEDY_TEMPERATURE = 1e-5
# Most alternatives a request may ask for per token (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Longest stop string, in characters: the output processor holds back (and searches) this much
# text on every token, so an unbounded one is work per token a single request could inflate.
MAX_STOP_STRING_LENGTH = 1024
MAX_N = 128
# Most logit_bias entries one request may carry: each is an index into every step's logits row.
# Ours (OpenAI documents no number); far above what a ban list or a few forced tokens need.
MAX_LOGIT_BIAS_ENTRIES = 1024
# OpenAI's range for a bias: -100 effectively bans the token, +100 effectively forces it.
MAX_ABS_LOGIT_BIAS = 100.0
# Seeds as OpenAI's API takes them (int64 or uint64); the generator uses them modulo 2**64.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# A token id as a string key of logit_bias: a non-negative decimal integer, short enough that it
# is never a huge number (the vocabulary check then says whether the model has it).
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``top_k`` is ``None`` when off (``-1`` and ``0`` from the wire mean off). ``logit_bias`` is
    OpenAI's map of token id -> bias added to that token's logit before sampling (keys may be
    ints or, as JSON carries them, decimal strings); it is kept as ``(token_id, bias)`` pairs
    sorted by id. ``logprobs`` is
    ``None`` when no log-probabilities are wanted, else the number of top alternatives to report
    per generated token (0 reports only the sampled token's). ``prompt_logprobs`` likewise for the
    prompt's tokens (used by completions with ``echo``). ``max_tokens`` counts generated tokens,
    a stop token included.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # Parallel samples of one prompt: computed once, its KV blocks forked (engine.llm_engine).
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise wire conventions first (frozen: go through object.__setattr__).
        if type(self.top_k) is int and self.top_k in (-1, 0):  # not bools: False == 0
            object.__setattr__(self, "top_k", None)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        def finite(param: str, value: float) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(param, f"{param} must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            finite(name, getattr(self, name))
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise bad("top_k", f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty",
                      f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", f"seed must be an integer in [-2**63, 2**64 - 1], got {_short(self.seed)}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be a positive integer, got {_short(self.max_tokens)}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be a non-negative integer, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_LENGTH:
                raise bad("stop", f"a stop string may be at most {MAX_STOP_STRING_LENGTH} characters, "
                                  f"got one of {len(s)}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids",
                          f"stop_token_ids must be non-negative integers, got {_short(t)}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"n must be between 1 and {MAX_N}, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id these params carry names a row of the model's logits: [0, vocab_size).

        ``vocab_size`` is the width of the logits (:attr:`ModelFacts.vocab_size`), which may be
        larger than the tokenizer's length (padded embeddings) but never what the tokenizer says.
        """
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids: {t} is not a token of this model (its vocabulary has "
                    f"{vocab_size} tokens: ids 0 to {vocab_size - 1})", param="stop_token_ids")
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias: {t} is not a token of this model (its vocabulary has "
                    f"{vocab_size} tokens: ids 0 to {vocab_size - 1})", param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def check_prompt_token_ids(token_ids: Sequence[Any], vocab_size: int, param: str = "prompt") -> None:
    """A prompt given as token ids: each an int in [0, vocab_size) (an id outside the embedding
    table would fail inside the forward pass, for every request in its batch)."""
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"{param}[{i}]: {_short(t)} is not a token of this model (its vocabulary has "
                f"{vocab_size} tokens: ids 0 to {vocab_size - 1})", param=param)


def _short(value: Any) -> str:
    """A value for an error message, never thousands of characters (a huge int or string)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _as_tuple(values: Any, param: str) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise InvalidRequestError(f"{param} must be a list, got {_short(values)}", param=param)
    return tuple(values)


def _logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{token id: bias}`` (keys ints or decimal strings) as sorted, checked pairs;
    an already-normalised tuple of pairs passes through the same checks."""
    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"logit_bias: {message}", param="logit_bias")

    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (tuple, list)) and all(isinstance(p, tuple) and len(p) == 2 for p in bias):
        items = list(bias)
    else:
        raise bad(f"must be a map of token id to bias, got {_short(bias)}")
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {len(items)}")
    pairs: dict[int, float] = {}
    for key, value in items:
        if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token_id = key
        else:
            raise bad(f"keys must be token ids (non-negative integers), got {_short(key)}")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS):
            raise bad(f"the bias for token {token_id} must be a number in [-100, 100], got {_short(value)}")
        if token_id in pairs:
            raise bad(f"token {token_id} appears more than once")
        pairs[token_id] = float(value)
    return tuple(sorted(pairs.items()))
