"""How much of a step background work may take (engine.priority, "Background requests").

Background requests (the gateway's batch lines) should use only capacity that foreground
(interactive) requests leave idle. What is idle depends on the hardware: on a GPU a decode step of
4 rows costs about what one of 40 does (the weights are read once, the arithmetic is nearly free),
while on a small CPU every extra row adds its arithmetic to the step. So the share is measured,
not configured: :class:`BackgroundShare` keeps every step that foreground work is in at most
``1 + slowdown`` times as long as it would be without background work, whatever the machine.

- **Busy steps** (a foreground request is unfinished). Background work may take ``allowance``
  tokens, a number found by feedback (additive increase, multiplicative decrease, as TCP finds
  a link's capacity): after each step that had some, its duration is compared with the
  *reference*, the recent duration of steps with the same foreground tokens and none of the
  background's: within ``1 + slowdown`` of it, the allowance grows by one token; past it, it is
  halved. The reference is measured by the busy steps that give background work nothing: the
  first ones of each foreground size, and then one in ``PROBE_EVERY``.
- **For ``grace_s`` after foreground work** (none unfinished, but some was a moment ago: a user
  reading a reply, a client about to send its next request) background work keeps the busy
  share, so a foreground request that arrives then waits for a small step, not a big one.
- **Steps without foreground work** (none for ``grace_s``): background work may take up to
  ``max_step_tokens`` of the step's budget. This bounds how long a foreground request that
  arrives meanwhile waits for the step under way to end (its time to first token), and costs
  the batch little: a step of a few hundred tokens already multiplies matrices about as
  efficiently as a bigger one.

Durations are of the engine's steps (``LLMEngine.launch`` to ``complete``), noted by the engine.
Pure Python, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PROBE_EVERY = 8
"""One busy step in this many gives background work nothing, to keep the reference current."""
REFERENCE_WEIGHT = 0.2
"""The weight of a new duration in a reference's running average."""
EXACT_TOKENS = 16
"""Foreground token counts up to this have a reference each; larger ones share one per power of
two (a prefill chunk's size varies; decode steps are what interactive latency is made of)."""


def size_class(num_tokens: int) -> int:
    """The reference a step of ``num_tokens`` foreground tokens is compared with."""
    if num_tokens <= EXACT_TOKENS:
        return num_tokens
    return 1 << (num_tokens - 1).bit_length()


class BackgroundShare:
    """The background tokens each step may take (see the module docstring)."""

    def __init__(self, slowdown: float, max_step_tokens: int, grace_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if slowdown < 0:
            raise ValueError(f"background slowdown must be at least 0, got {slowdown}")
        if max_step_tokens < 1:
            raise ValueError(f"background max step tokens must be at least 1, got {max_step_tokens}")
        if grace_s < 0:
            raise ValueError(f"background grace must be at least 0 seconds, got {grace_s}")
        self.slowdown = slowdown
        self.max_step_tokens = max_step_tokens
        self.grace_s = grace_s
        self._clock = clock
        self._last_foreground = float("-inf")
        self.allowance = 1.0
        self._reference: dict[int, float] = {}  # size class -> seconds, running average
        self._num_busy_steps = 0
        self._adaptive = True

    def fix(self, allowance: int) -> None:
        """Give busy steps exactly ``allowance`` background tokens from now on (tests; a
        measured share depends on the machine's timings)."""
        self.allowance, self._adaptive = float(allowance), False

    def busy(self, foreground: bool) -> bool:
        """Whether the step being scheduled gets the busy share: foreground work is unfinished
        (``foreground``), or was less than ``grace_s`` ago."""
        now = self._clock()
        if foreground:
            self._last_foreground = now
        return foreground or now - self._last_foreground < self.grace_s

    def tokens(self, busy: bool, foreground_tokens: int) -> int:
        """The background tokens the step being scheduled may take, given whether it gets the
        busy share (``busy``) and the foreground tokens scheduled so far."""
        if not busy:
            return self.max_step_tokens
        if not self._adaptive:
            return int(self.allowance)
        # A step in the grace period has no foreground tokens: it is held to what one
        # foreground decode would allow.
        if self.slowdown == 0 or self._probing(max(1, foreground_tokens)):
            return 0
        return int(self.allowance)

    def observe(self, foreground_tokens: int, background_tokens: int, busy: bool,
                seconds: float) -> None:
        """A step ended: ``seconds`` from launch to completion, its tokens of each kind, and
        whether it got the busy share. Only steps with foreground tokens teach anything."""
        if not busy or not self._adaptive or foreground_tokens == 0:
            return
        self._num_busy_steps += 1
        key = size_class(foreground_tokens)
        reference = self._reference.get(key)
        if background_tokens == 0:
            self._reference[key] = seconds if reference is None else (
                (1 - REFERENCE_WEIGHT) * reference + REFERENCE_WEIGHT * seconds)
        elif reference is not None:
            if seconds > (1 + self.slowdown) * reference:
                self.allowance = max(1.0, self.allowance / 2)
            else:
                self.allowance = min(float(self.max_step_tokens), self.allowance + 1)

    def _probing(self, foreground_tokens: int) -> bool:
        """Whether this busy step measures the reference (gives background work nothing)."""
        return (size_class(foreground_tokens) not in self._reference
                or self._num_busy_steps % PROBE_EVERY == PROBE_EVERY - 1)


class StepShare:
    """One step's accounting while the scheduler fills it: background sequences get what
    :meth:`BackgroundShare.tokens` allows, decided when the first of them is reached (after the
    foreground sequences ahead of it in the queues, which are served first)."""

    def __init__(self, share: BackgroundShare, busy: bool) -> None:
        self.share = share
        self.busy = busy
        self.foreground_tokens = 0
        self.background_tokens = 0
        self._limit: int | None = None

    def allowance(self, background: bool, budget: int) -> int:
        """The tokens a sequence may take of the step's ``budget`` left."""
        if not background:
            return budget
        if self._limit is None:
            self._limit = self.share.tokens(self.busy, self.foreground_tokens)
        return max(0, min(budget, self._limit - self.background_tokens))

    def took(self, background: bool, num_tokens: int) -> None:
        if background:
            self.background_tokens += num_tokens
        else:
            self.foreground_tokens += num_tokens
