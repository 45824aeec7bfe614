"""What runs inside a grammar process (:mod:`.grammar_process`): xgrammar's compiles, the probe
that times a new grammar's first masks, and the matchers whose masks the engine asks for.

xgrammar's calls cannot be interrupted: a pathological grammar (``(.{1,50}){1,50}x`` takes 2 s
for its first mask and doubles per token) holds the thread that calls it for as long as it likes.
So every call that depends on a client's grammar runs here, in a child process the parent kills
when the call passes its deadline: the CPU it was burning is given back at once.

The protocol is one request message, then replies on the same pipe (all plain tuples):

- ``("setup", tokenizer_info_json)`` -> ``("ok",)``
- ``("compile", kind, source, strict, max_whitespace, probe_tokens, budget_s, max_bytes,
  after)`` (``after``: a reasoning model's end-of-thoughts tag the constraint starts after, or "")
  -> ``("probe", position)`` before each mask the probe computes (the parent times each one
  and kills the process at the budget), then ``("compiled", grammar_json, memory_size_bytes,
  probe_s)`` | ``("refused", message)``
- ``("fill", closes, loads, items)`` with ``closes: [mid]``, ``loads: [(gid, grammar_json)]``,
  ``items: [(mid, opening, new_token_ids)]`` where ``opening`` is ``(gid, stop_token_ids)``
  for a matcher this process has not seen (its ``new_token_ids`` are then all it accepted):
  one ``("row", mid, words_bytes)`` or ``("row_error", mid, message)`` per item, in order, then
  ``("done",)``. The parent times each row on its own.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

_KINDS_JSON = ("json_schema", "json_object")


class _State:
    def __init__(self, tokenizer_info_json: str) -> None:
        self.info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        self.vocab_size = self.info.vocab_size
        self.compiler: xgr.GrammarCompiler | None = None
        self.grammars: dict[int, xgr.CompiledGrammar] = {}
        self.matchers: dict[int, tuple[int, xgr.GrammarMatcher]] = {}  # mid -> (gid, matcher)
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        # Characters each token stands for: the probe walks the longest allowed tokens, the
        # path on which an ambiguous grammar's parser states grow fastest.
        self.token_chars = np.array([len(t) for t in self.info.decoded_vocab], dtype=np.int64)
        self.stop_ids = np.array(sorted(int(t) for t in self.info.stop_token_ids), dtype=np.int64)


def serve(conn: Any) -> None:
    """The child's loop: answer requests until the parent closes the pipe."""
    _die_with_parent()
    torch.set_num_threads(1)
    state: _State | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        if op == "setup":
            state = _State(message[1])
            conn.send(("ok",))
        elif op == "compile":
            assert state is not None
            conn.send(_compile(state, conn, *message[1:]))
        elif op == "fill":
            assert state is not None
            _fill(state, conn, *message[1:])
        else:
            raise AssertionError(f"unknown grammar process request {op!r}")


def _compile(state: _State, conn: Any, kind: str, source: str, strict: bool,
             max_whitespace: int | None, probe_tokens: int, budget_s: float,
             max_bytes: int, after: str = "") -> tuple:
    if state.compiler is None:
        # One thread per compile: the parent runs several processes for parallelism.
        state.compiler = xgr.GrammarCompiler(state.info, max_threads=1, cache_enabled=False)
    compiler = state.compiler
    try:
        if after:
            # Free text up to the end of the thoughts, then the constraint: one grammar, so the
            # answer is constrained exactly as it would be without thoughts before it.
            thoughts = xgr.Grammar.from_structural_tag(json.dumps({
                "type": "structural_tag", "format": {
                    "type": "tag", "begin": "", "content": {"type": "any_text"}, "end": after}}))
            # Models write a blank line or so before the answer (the gateway drops it).
            blank = xgr.Grammar.from_ebnf(f"root ::= [ \\t\\n\\r]{{0,{max_whitespace or 16}}}")
            answer = _grammar(kind, source, strict, max_whitespace)
            grammar = compiler.compile_grammar(xgr.Grammar.concat(thoughts, blank, answer))
        elif kind == "json_schema":
            grammar = compiler.compile_json_schema(source, strict_mode=strict, any_whitespace=True,
                                                   max_whitespace_cnt=max_whitespace)
        elif kind == "json_object":
            grammar = compiler.compile_json_schema('{"type":"object"}', strict_mode=False,
                                                   any_whitespace=True,
                                                   max_whitespace_cnt=max_whitespace)
        elif kind == "regex":
            grammar = compiler.compile_regex(source)
        elif kind == "grammar":
            grammar = compiler.compile_grammar(source)
        else:  # choice, structural_tag: both arrive as a structural tag
            grammar = compiler.compile_structural_tag(source)
    except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError,
            xgr.InvalidStructuralTagError) as e:
        return ("refused", f"does not compile: {first_line(e)}")
    size = int(grammar.memory_size_bytes)
    if size > max_bytes:  # before the probe: no time spent on a grammar that cannot be kept
        mib = 1024 * 1024
        return ("refused", f"is too large: it compiles to {size / mib:.1f} MiB, over the limit "
                           f"of {max_bytes / mib:g} MiB per grammar; simplify it")
    started = time.perf_counter()
    refusal = _probe(state, conn, grammar, probe_tokens, budget_s)
    probe_s = time.perf_counter() - started
    if refusal is not None:
        return ("refused", refusal)
    return ("compiled", grammar.serialize_json(), size, probe_s)


def _grammar(kind: str, source: str, strict: bool, max_whitespace: int | None) -> xgr.Grammar:
    """The uncompiled grammar of one constraint (as the compile calls above build it)."""
    if kind in _KINDS_JSON:
        schema = source if kind == "json_schema" else '{"type":"object"}'
        return xgr.Grammar.from_json_schema(schema, strict_mode=strict and kind == "json_schema",
                                            any_whitespace=True, max_whitespace_cnt=max_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(source)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(source)
    return xgr.Grammar.from_structural_tag(source)


def _probe(state: _State, conn: Any, grammar: xgr.CompiledGrammar, num_tokens: int,
           budget_s: float) -> str | None:
    """Walks up to ``num_tokens`` tokens through a new grammar, always taking the allowed token
    that consumes the most characters, and times each mask. Returns why the grammar is refused:
    no token can start its output, or one mask took longer than the per-token budget (a grammar
    whose masks are slow on this walk would hold every step it takes part in)."""
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = state.bitmask
    for position in range(num_tokens):
        conn.send(("probe", position))
        started = time.thread_time()  # CPU time: a busy machine does not make a grammar slow
        matcher.fill_next_token_bitmask(bitmask, 0)
        elapsed = time.thread_time() - started
        if elapsed > budget_s:
            return (f"is too slow to follow: choosing output token {position + 1} took "
                    f"{elapsed * 1000:.0f} ms, over the per-token budget of "
                    f"{budget_s * 1000:.0f} ms; simplify it (nested repetitions such as "
                    "(.{1,50}){1,50} make every token slower than the last)")
        allowed = _allowed_ids(bitmask[0], state.vocab_size)
        choices = allowed[~np.isin(allowed, state.stop_ids)]
        if position == 0 and not len(allowed):
            return "cannot be satisfied: no token may start the output"
        if not len(choices):
            return None  # the walk reached the end of the output
        token_id = int(choices[np.argmax(state.token_chars[choices])])
        if not matcher.accept_token(token_id):
            return None  # the mask and the matcher disagree; nothing more to learn here
    return None


def _allowed_ids(words: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def _fill(state: _State, conn: Any, closes: list[int], loads: list[tuple[int, str]],
          items: list[tuple[int, tuple[int, list[int]] | None, list[int]]]) -> None:
    for mid in closes:
        state.matchers.pop(mid, None)
    in_use = {gid for gid, _ in state.matchers.values()}
    for gid in list(state.grammars):
        if gid not in in_use:
            del state.grammars[gid]
    for gid, grammar_json in loads:
        state.grammars[gid] = xgr.CompiledGrammar.deserialize_json(grammar_json, state.info)
    bitmask = state.bitmask
    for mid, opening, token_ids in items:
        if opening is not None:
            gid, stop_token_ids = opening
            matcher = xgr.GrammarMatcher(state.grammars[gid],
                                         override_stop_tokens=stop_token_ids or None)
            state.matchers[mid] = (gid, matcher)
        matcher = state.matchers[mid][1]
        refused = next((t for t in token_ids if not matcher.accept_token(int(t))), None)
        if refused is not None:
            conn.send(("row_error", mid, f"token {refused} is not allowed by the output's grammar"))
            continue
        if matcher.is_terminated():
            conn.send(("row_error", mid, "the output's grammar has already ended"))
            continue
        matcher.fill_next_token_bitmask(bitmask, 0)
        conn.send(("row", mid, bitmask[0].numpy().tobytes()))
    conn.send(("done",))


def first_line(error: BaseException) -> str:
    """xgrammar's C++ errors read ``[time] /path/file.cc:123: message``; keep the message."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    if text.startswith("[") and ".cc:" in text:
        text = text.split(".cc:", 1)[1].split(": ", 1)[-1]
    return text


def _die_with_parent() -> None:
    """A child stuck in a long xgrammar call notices its parent's death only when the call
    returns; ask Linux to kill it along with the parent instead."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe's EOF is the only signal
        pass
