"""What `llmplatform serve` does when one of its services exits: the decision alone, no processes
(the supervisor acts on it), the clock passed in, so the rules are tested exactly.

An exit is restarted after a backoff that doubles with each restart of that service within the
window (1 s, 2 s, 4 s ... up to ``max_backoff_s``), at most ``max_restarts_per_minute`` times in
it. One exit more means restarting does not help, and then it depends on what the service is:

- a **degradable** service (a model worker, the web UI) is *left down*: the rest of the
  deployment keeps serving, and it is retried after ``down_retry_s``. A retry that exits again
  within the window is left down again at once, its next retry twice as late (up to
  ``max_down_retry_s``): a crash any client can trigger costs one worker, never the deployment,
  and a loop that keeps crashing costs a start every so often, not a CPU. A retry that stays up
  for the window is healthy again: its history starts over.
- the controller and the gateway are **fatal**: nothing can be served without them, so serve
  stops everything and says why (a supervisor above it, systemd or Kubernetes, restarts it all).
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts_per_minute: int = 5
    """Restarts of one service within `window_s`; the exit after that many is a crash loop. 0:
    the first exit is."""
    initial_backoff_s: float = 1.0
    """Delay before a service's first restart within the window; doubles with each next one."""
    max_backoff_s: float = 30.0
    down_retry_s: float = 60.0
    """Delay before the first retry of a service left down; doubles with each failed retry."""
    max_down_retry_s: float = 900.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts_per_minute < 0:
            raise ValueError(f"max_restarts_per_minute must be >= 0, got {self.max_restarts_per_minute}")
        for name in ("initial_backoff_s", "max_backoff_s", "down_retry_s", "max_down_retry_s",
                     "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def backoff_s(self, restart_number: int) -> float:
        """Delay before the ``restart_number``-th restart (1-based) within the window."""
        return min(max(self.max_backoff_s, self.initial_backoff_s),
                   self.initial_backoff_s * 2 ** (restart_number - 1))

    def down_retry_delay_s(self, down_number: int) -> float:
        """Delay before retrying a service left down for the ``down_number``-th time in a row."""
        return min(max(self.max_down_retry_s, self.down_retry_s),
                   self.down_retry_s * 2 ** min(down_number - 1, 32))


class Verdict(enum.Enum):
    RESTART = "restart"
    """Start it again after `delay_s`."""
    DOWN = "down"
    """Leave it down; retry it after `delay_s`; the rest keeps serving."""
    FATAL = "fatal"
    """Nothing can serve without it: stop everything."""


@dataclass(frozen=True)
class ExitDecision:
    verdict: Verdict
    delay_s: float
    number: int
    """RESTART: which restart within the window (1-based); DOWN: how many times in a row it has
    been left down; FATAL: the restarts the window held."""
    reason: str
    """Why, in words, for the log, the controller's list and /health (DOWN and FATAL)."""


class RestartHistory:
    """One service's recent exits, and the decision for the next one."""

    def __init__(self, policy: RestartPolicy, *, degradable: bool) -> None:
        self.policy = policy
        self.degradable = degradable
        self._restart_times: collections.deque[float] = collections.deque()
        self._started_at: float | None = None
        self.times_down = 0
        """How many times in a row it has been left down (0: not in a crash loop)."""

    @property
    def restarts_in_window(self) -> int:
        """Restarts counted in the window as of the last exit."""
        return len(self._restart_times)

    def started(self, now: float) -> None:
        self._started_at = now

    def exited(self, now: float, how: str) -> ExitDecision:
        """The decision for an exit at ``now``; ``how`` says how it exited (for the reason)."""
        policy = self.policy
        lived_s = None if self._started_at is None else now - self._started_at
        if self.times_down and lived_s is not None and lived_s >= policy.window_s:
            self.times_down = 0  # the last retry held: a new exit is judged afresh
        while self._restart_times and now - self._restart_times[0] >= policy.window_s:
            self._restart_times.popleft()
        if self.times_down:
            self.times_down += 1
            return ExitDecision(
                Verdict.DOWN, policy.down_retry_delay_s(self.times_down), self.times_down,
                f"exited again ({how}) {lived_s or 0:.0f} s after being retried")
        restarts = len(self._restart_times)
        if restarts >= policy.max_restarts_per_minute:
            reason = (f"exited unexpectedly ({how}) {restarts + 1} times within "
                      f"{policy.window_s:g} s (restarts allowed: {policy.max_restarts_per_minute}, "
                      "--max-restarts-per-minute)")
            if not self.degradable:
                return ExitDecision(Verdict.FATAL, 0.0, restarts, reason)
            self._restart_times.clear()
            self.times_down = 1
            return ExitDecision(Verdict.DOWN, policy.down_retry_delay_s(1), 1, reason)
        self._restart_times.append(now)
        return ExitDecision(Verdict.RESTART, policy.backoff_s(restarts + 1), restarts + 1,
                            f"exited unexpectedly ({how})")
