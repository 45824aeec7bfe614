"""Sampling parameters: one validated type shared by every backend.

Validation happens at construction, so a backend never sees an out-of-range value; each failure is
an :class:`InvalidRequestError` naming the offending parameter (it becomes a 400 at the edge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmplatform.errors import InvalidRequestError

# Temperatures below this are treated as greedy decoding (FastChat's convention).
GREEDY_TEMPERATURE = 1e-5
# Most alternatives a request may ask for per token (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 128


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``top_k`` is ``None`` when off (``-1`` and ``0`` from the wire mean off). ``logprobs`` is
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
    # Parallel samples of one prompt (offline API / engine); the gateway fans ``n`` out itself.
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise wire conventions first (frozen: go through object.__setattr__).
        if type(self.top_k) is int and self.top_k in (-1, 0):  # not bools: False == 0
            object.__setattr__(self, "top_k", None)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
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
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be a non-negative integer, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", f"stop_token_ids must be non-negative integers, got {t!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"n must be between 1 and {MAX_N}, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
