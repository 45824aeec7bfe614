"""A child process that runs xgrammar calls for us and can be killed when one takes too long.

See :mod:`.grammar_child` for why and for the messages. Processes come from a fork server
started on first use, with xgrammar (and so torch) already imported there: a new process is a
fork of it (tens of milliseconds), not a fresh interpreter (seconds), and it has none of the
parent's threads. A process is given the tokenizer's xgrammar description once, at start.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

from llmplatform.sampling import grammar_child

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
    """One child. Not thread-safe: one caller at a time (each owner holds its own)."""

    def __init__(self, tokenizer_info_json: str, *, name: str = "grammar") -> None:
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

    def kill(self) -> None:
        """Stop it now, whatever it is doing (SIGKILL: xgrammar ignores nothing else sooner)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=5)
        self._conn.close()
