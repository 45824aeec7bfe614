"""A child process that runs xgrammar calls for us and can be killed when one takes too long.

See :mod:`.grammar_child` for why and for the messages. Processes come from a fork server
started on first use, with xgrammar (and so torch) already imported there: a new process is a
fork of it (tens of milliseconds), not a fresh interpreter (seconds), and it has none of the
parent's threads. A process is given the tokenizer's xgrammar description once, at start.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import Any

from llmplatform.sampling import grammar_child

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_context_lock = threading.Lock()
_context: Any = None


def _mp_context() -> Any:
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([grammar_child.__name__])
            _context = context
        return _context


class GrammarProcessDied(RuntimeError):
    """The process ended (killed by us, or crashed) before it answered."""


class GrammarProcess:
    """One child. Not thread-safe: one caller at a time (each owner holds its own), except
    :meth:`kill`, which a pool's ``close`` may call while the caller kills it at a deadline."""

    def __init__(self, tokenizer_info_json: str, *, name: str = "grammar") -> None:
        self._kill_lock = threading.Lock()
        self._killed = False
        context = _mp_context()
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(target=grammar_child.serve, args=(child_conn,),
                                         name=name, daemon=True)
        self._process.start()
        child_conn.close()
        self.send(("setup", tokenizer_info_json))
        reply = self.receive(deadline=time.monotonic() + 120.0)
        if reply != ("ok",):
            self.kill()
            raise GrammarProcessDied(f"the grammar process did not start: {reply!r}")

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self._conn.closed

    def send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as e:
            raise GrammarProcessDied(f"the grammar process is gone ({e})") from None

    def receive(self, *, deadline: float) -> tuple | None:
        """The next reply, or None once ``deadline`` (time.monotonic()) passes first."""
        try:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                return None
            return self._conn.recv()
        except (EOFError, OSError, ValueError):
            raise GrammarProcessDied("the grammar process ended before it answered") from None

    def receive_within_cpu(self, cpu_budget_s: float, *, wall_limit_s: float) -> tuple | None:
        """The next reply, or None once the process has spent ``cpu_budget_s`` of CPU time
        waiting for it, or ``wall_limit_s`` have passed. A budget in CPU time, not wall time:
        on a busy machine a process that was not scheduled is not what is slow, and is given
        the time it did not get (up to the wall limit); one that computes is cut off on time.
        Without /proc, the budget is wall time."""
        started = time.monotonic()
        wall_deadline = started + wall_limit_s
        cpu_at_start = self.cpu_seconds()
        deadline = started + cpu_budget_s
        while True:
            reply = self.receive(deadline=min(deadline, wall_deadline))
            now = time.monotonic()
            if reply is not None or now >= wall_deadline or cpu_at_start is None:
                return reply
            cpu_now = self.cpu_seconds()
            if cpu_now is None or cpu_now - cpu_at_start >= cpu_budget_s:
                return None
            # Starved, not slow: wait for the CPU time it has left (at least one clock tick).
            deadline = now + max(cpu_budget_s - (cpu_now - cpu_at_start), 0.01)

    def cpu_seconds(self) -> float | None:
        """User + system CPU time the process has used (Linux /proc; None elsewhere)."""
        try:
            with open(f"/proc/{self._process.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError, TypeError):
            return None
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def kill(self) -> None:
        """Stop it now, whatever it is doing (SIGKILL: xgrammar ignores nothing else sooner).
        Once: a second call, from another thread too, does nothing (closing the pipe twice
        could close a descriptor the process has reused since)."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=5)
            self._conn.close()
