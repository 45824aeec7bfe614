"""The engine's grammar matchers, kept in a child process so that no request's grammar can hold
the step for everyone.

Filling a sequence's mask is xgrammar's work on that sequence's grammar, and its cost is the
grammar's: an ambiguous one gets slower with every token (``(.{1,20}){1,20}x``: 0.3, 1.4, 3.3,
8, 19, 38 s for its first six masks) and the call cannot be interrupted. The compiler's probe
(:mod:`.grammar`) refuses grammars that are slow on their first tokens; this is the guard for
the rest. A :class:`GrammarSandbox` keeps every constrained sequence's matcher in one grammar
process (:mod:`.grammar_process`) and asks it for a batch's masks row by row, each row with its
own deadline, the *per-token budget* (CPU time). A row past its deadline is the request's fault: the
process is killed (its CPU given back at once), that request is failed with a 400-class error,
and a fresh process takes over the others, each matcher rebuilt from the tokens its sequence
accepted (microseconds per token). So one request can hold a step for at most one budget, once.

:class:`RemoteGrammar` has :class:`~.grammar_matcher.SequenceGrammar`'s interface. It accepts
tokens locally (checked against the mask it was sampled under) and sends them with the next
fill; a matcher whose sequence is gone is closed in the process with the next fill.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Sequence

import torch

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.grammar_matcher import allow_only
from llmplatform.sampling.grammar_process import GrammarProcess, GrammarProcessDied

if TYPE_CHECKING:
    from llmplatform.sampling.grammar import CompiledGrammar

_matcher_ids = itertools.count(1)
# Loading grammars into a new process is bounded by their size (max_grammar_bytes); this is far
# beyond what that takes, and only a broken process misses it.
_LOAD_ALLOWANCE_S = 10.0
# A mask's budget is CPU time; on a busy machine its wall time may reach this many budgets.
_STARVED_LIMIT = 20


class GrammarBudgetError(InvalidRequestError):
    """A constrained request's grammar took longer than the per-token budget for one mask, or
    its process failed on it: that request's fault, failed alone."""


class RemoteGrammar:
    """One sequence's walk through its grammar, its matcher living in the sandbox's process."""

    def __init__(self, sandbox: GrammarSandbox, compiled: CompiledGrammar,
                 stop_token_ids: Sequence[int] | None) -> None:
        self.compiled = compiled
        self.mid = next(_matcher_ids)
        self._sandbox = sandbox
        self._override_stops = list(stop_token_ids) if stop_token_ids else None
        self._stop_token_ids = frozenset(
            self._override_stops or (int(t) for t in compiled.tokenizer_info.stop_token_ids))
        self._accepted: list[int] = []
        self._terminated = False
        self.failed: GrammarBudgetError | None = None
        # Set by the sandbox: the process generation holding this matcher, how many accepted
        # tokens it has seen, and the mask it computed at the current position (None: stale).
        self.generation: int | None = None
        self.num_synced = 0
        self.mask: torch.Tensor | None = None
        weakref.finalize(self, sandbox.release, self.mid)

    # ---- SequenceGrammar's interface ----------------------------------------------------

    @property
    def accepted_token_ids(self) -> tuple[int, ...]:
        return tuple(self._accepted)

    @property
    def num_accepted(self) -> int:
        return len(self._accepted)

    @property
    def stop_token_ids(self) -> list[int]:
        return sorted(self._stop_token_ids)

    @property
    def opening(self) -> tuple[int, list[int] | None]:
        """What a process needs to create this matcher: its grammar and stop tokens."""
        return self.compiled.grammar_id, self._override_stops

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            allow_only(bitmask, row, self._stop_token_ids)
            return
        failures = self._sandbox.fill([self])
        if failures:
            raise failures[self]
        bitmask[row].copy_(self.mask)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token: allowed if the last mask allowed it (the process checks
        again when it replays). False leaves the state unchanged."""
        token_id = int(token_id)
        if self._terminated or self.failed is not None:
            return False
        if self.mask is not None and not _allows(self.mask, token_id):
            return False
        self._accepted.append(token_id)
        self.mask = None
        # A stop token is allowed only where the output may end, and accepting it ends it.
        self._terminated = token_id in self._stop_token_ids
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def replay(self, token_ids: Sequence[int]) -> None:
        """Rebuild from ``token_ids``; the process checks them on the next fill (a token the
        grammar does not allow then fails the request)."""
        self._accepted = [int(t) for t in token_ids]
        self._terminated = bool(self._accepted) and self._accepted[-1] in self._stop_token_ids
        self.generation = None  # reopened, with every token, by the next fill
        self.mask = None


class GrammarSandbox:
    """Every matcher of one engine, in one grammar process (started on first use)."""

    def __init__(self, tokenizer_info_json: str, *, token_budget_s: float) -> None:
        self.token_budget_s = token_budget_s
        self._tokenizer_info_json = tokenizer_info_json
        self._slot = _ProcessSlot()
        self._generation = 0
        self._open: dict[int, int] = {}  # mid -> grammar id, in the current process
        self._released: deque[int] = deque()  # mids whose sequences are gone
        self._lock = threading.Lock()
        self.num_budget_failures = 0  # requests failed for a slow mask
        # The process dies with the sandbox (an engine dropped without a close).
        weakref.finalize(self, self._slot.kill)

    def new_matcher(self, compiled: CompiledGrammar, *,
                    stop_token_ids: Sequence[int] | None = None) -> RemoteGrammar:
        return RemoteGrammar(self, compiled, stop_token_ids)

    def release(self, mid: int) -> None:
        """Called when a matcher is garbage: closed in the process with the next fill."""
        self._released.append(mid)

    def fill(self, grammars: Sequence[RemoteGrammar]) -> dict[RemoteGrammar, GrammarBudgetError]:
        """Compute the mask at each grammar's current position (``grammar.mask``), those not
        computed yet, in the process. Returns the grammars that failed; the others have their
        mask. A failed grammar stays failed."""
        with self._lock:
            failures = {g: g.failed for g in grammars if g.failed is not None}
            pending = [g for g in grammars
                       if g.failed is None and not g.is_terminated() and g.mask is None]
            while pending:
                pending = self._fill_once(pending, failures)
            return failures

    def close(self) -> None:
        with self._lock:
            self._slot.kill()

    # ---- one round trip; on a row past its budget, the rows after it come back to retry ------

    def _fill_once(self, pending: list[RemoteGrammar],
                   failures: dict[RemoteGrammar, GrammarBudgetError]) -> list[RemoteGrammar]:
        process = self._ensure_process()
        closes = []
        while self._released:
            mid = self._released.popleft()
            if self._open.pop(mid, None) is not None:
                closes.append(mid)
        loaded = set(self._open.values())
        loads, items = [], []
        for grammar in pending:
            gid, stops = grammar.opening
            if grammar.generation != self._generation:
                opening, tokens = (gid, stops), list(grammar.accepted_token_ids)
                if gid not in loaded:
                    loads.append((gid, grammar.compiled.serialized))
                    loaded.add(gid)
                self._open[grammar.mid] = gid
            else:
                opening, tokens = None, list(grammar.accepted_token_ids[grammar.num_synced:])
            items.append((grammar.mid, opening, tokens))
        try:
            process.send(("fill", closes, loads, items))
        except GrammarProcessDied:
            self._restart()
            return pending
        # Each row's budget is CPU time (a starved process is given the time it did not get, up
        # to _STARVED_LIMIT budgets); the first row's also covers loading the grammars.
        allowance = _LOAD_ALLOWANCE_S if loads else 0.0
        for index, grammar in enumerate(pending):
            try:
                reply = process.receive_within_cpu(
                    self.token_budget_s + allowance,
                    wall_limit_s=_STARVED_LIMIT * self.token_budget_s + allowance)
            except GrammarProcessDied:
                reply = None
            if reply is None:
                self._fail(grammar, failures, self._too_slow(grammar))
                self._restart()
                return pending[index + 1:]
            if reply[0] == "row_error":
                param = grammar.compiled.spec.param
                self._fail(grammar, failures, GrammarBudgetError(f"{param}: {reply[2]}",
                                                                 param=param))
            else:
                grammar.mask = torch.frombuffer(bytearray(reply[2]), dtype=torch.int32)
                grammar.generation = self._generation
                grammar.num_synced = grammar.num_accepted
            allowance = 0.0
        if process.receive(deadline=time.monotonic() + _LOAD_ALLOWANCE_S) != ("done",):
            self._restart()
        return []

    def _too_slow(self, grammar: RemoteGrammar) -> GrammarBudgetError:
        self.num_budget_failures += 1
        param = grammar.compiled.spec.param
        return GrammarBudgetError(
            f"{param}: choosing the next token took longer than the per-token budget of "
            f"{self.token_budget_s * 1000:.0f} ms (the grammar gets slower as the output "
            "grows); simplify it", param=param)

    @staticmethod
    def _fail(grammar: RemoteGrammar, failures: dict, error: GrammarBudgetError) -> None:
        grammar.failed = error
        failures[grammar] = error

    def _ensure_process(self) -> GrammarProcess:
        if self._slot.process is None or not self._slot.process.alive:
            if self._slot.process is not None:
                self._restart()
            self._slot.process = GrammarProcess(self._tokenizer_info_json, name="grammar-masks")
        return self._slot.process

    def _restart(self) -> None:
        """Kill the process; every matcher is rebuilt in the next one on its next fill."""
        if self._slot.process is not None:
            self._slot.process.kill()
        self._slot.process = None
        self._generation += 1
        self._open.clear()
        self._released.clear()


class _ProcessSlot:
    """The sandbox's current process, apart from the sandbox so that a finalizer can hold it."""

    def __init__(self) -> None:
        self.process: GrammarProcess | None = None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process = None


def _allows(mask: torch.Tensor, token_id: int) -> bool:
    word, bit = divmod(token_id, 32)
    return word < mask.shape[0] and bool((int(mask[word]) >> bit) & 1)


def fill_remote_grammars(grammars: Sequence[object]) -> dict[RemoteGrammar, GrammarBudgetError]:
    """Computes the masks of every :class:`RemoteGrammar` among ``grammars`` (other entries,
    None or local matchers, are skipped), one round trip per sandbox. Returns the ones that
    failed; the others' masks are then ready for :func:`~.grammar_matcher.fill_bitmasks`."""
    by_sandbox: dict[GrammarSandbox, list[RemoteGrammar]] = {}
    for grammar in grammars:
        if isinstance(grammar, RemoteGrammar):
            by_sandbox.setdefault(grammar._sandbox, []).append(grammar)
    failures: dict[RemoteGrammar, GrammarBudgetError] = {}
    for sandbox, group in by_sandbox.items():
        failures.update(sandbox.fill(group))
    return failures
