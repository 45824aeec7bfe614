"""Constrained decoding on xgrammar: compile a spec once, then mask each sequence's logits row.

Three pieces, each usable on its own:

- :class:`GrammarCompiler` turns a :class:`~.structured_output.StructuredOutputSpec` into a
  :class:`CompiledGrammar` for one tokenizer. Compiling (building the per-token mask cache) takes
  tens of milliseconds to seconds, so :meth:`~GrammarCompiler.compile` runs it on a small thread
  pool, never on the caller's thread; the result lands in a bounded LRU (:class:`GrammarCache`)
  keyed by (tokenizer fingerprint, compile options, spec). Concurrent requests for one key share
  one compile. A compile that outlasts the time limit is refused with an
  :class:`~llmplatform.errors.InvalidRequestError` (a 400), but keeps running and is cached when
  it finishes, so a retry hits the cache; a compile nobody waits for any more is cancelled if it
  has not started.
- :class:`SequenceGrammar` is one sequence's position in its grammar: fill its bitmask row,
  :meth:`~SequenceGrammar.accept` the sampled token, :meth:`~SequenceGrammar.rollback` or
  :meth:`~SequenceGrammar.replay` (rebuild from the accepted tokens, e.g. after the engine rebuilt
  the sequence).
- :func:`fill_bitmasks` / :func:`apply_bitmask` mask only the constrained rows of a logits batch
  (xgrammar's CPU kernel on CPU, its Triton kernel on CUDA); free rows are not touched.
  These last two pieces live in :mod:`.grammar_matcher` and are re-exported here.

End of output: the matcher's stop tokens are the model's EOS ids (plus any the request adds).
While the grammar can still continue they are allowed only where the grammar may end; once it is
complete and cannot continue, the mask allows *only* them. The sampler therefore picks EOS, the
engine's ordinary EOS check ends the sequence with ``finish_reason: "stop"``, and
:meth:`SequenceGrammar.accept` of that EOS marks the matcher terminated. Two rules keep this
sound: the grammar mask is applied *after* every other logits edit (penalties, logit_bias), and a
constrained row skips the min_tokens/ignore_eos EOS masking (the grammar decides when the output
may end; masking EOS at that point would leave no allowed token).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
import xgrammar as xgr

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.grammar_matcher import (
    SequenceGrammar, allocate_bitmask, apply_bitmask, fill_bitmasks,
)
from llmplatform.sampling.structured_output import StructuredOutputKind, StructuredOutputSpec

__all__ = [
    "CompiledGrammar", "GrammarCache", "GrammarCompiler", "GrammarConfig", "SequenceGrammar",
    "allocate_bitmask", "apply_bitmask", "fill_bitmasks",
]

_WHAT = {
    StructuredOutputKind.JSON_SCHEMA: "the JSON schema",
    StructuredOutputKind.JSON_OBJECT: "the JSON object grammar",
    StructuredOutputKind.REGEX: "the regular expression",
    StructuredOutputKind.CHOICE: "the choices",
    StructuredOutputKind.GRAMMAR: "the grammar",
    StructuredOutputKind.STRUCTURAL_TAG: "the tool-call grammar",
}


@dataclass(frozen=True)
class GrammarConfig:
    """The grammar compiler's section of the config."""

    max_cached_grammars: int = 256  # compiled grammars kept (LRU); each is ~50 KB to a few MB
    compile_timeout_s: float = 10.0  # a request whose grammar takes longer gets a 400
    max_concurrent_compiles: int = 2  # compile pool threads; further compiles queue
    threads_per_compile: int = 2  # xgrammar's own parallelism inside one compile
    # Longest run of whitespace a JSON output may contain between tokens; None: unbounded.
    # Small models left free tend to emit newlines forever inside an open object.
    max_whitespace_chars: int | None = 16

    def __post_init__(self) -> None:
        if self.max_cached_grammars < 1:
            raise ValueError("max_cached_grammars must be >= 1")
        if not self.compile_timeout_s > 0:
            raise ValueError("compile_timeout_s must be > 0")
        if self.max_concurrent_compiles < 1 or self.threads_per_compile < 1:
            raise ValueError("max_concurrent_compiles and threads_per_compile must be >= 1")
        if self.max_whitespace_chars is not None and self.max_whitespace_chars < 1:
            raise ValueError("max_whitespace_chars must be >= 1 or None")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer; immutable and shared by every sequence using it."""

    spec: StructuredOutputSpec
    handle: xgr.CompiledGrammar
    vocab_size: int  # the logits width the bitmask covers

    @property
    def memory_size_bytes(self) -> int:
        return int(self.handle.memory_size_bytes)

    def new_matcher(self, *, stop_token_ids: Sequence[int] | None = None) -> SequenceGrammar:
        return SequenceGrammar(self, stop_token_ids=stop_token_ids)


class GrammarCache:
    """A thread-safe LRU of compiled grammars, bounded by entry count. One cache may be shared by
    several compilers: keys start with the tokenizer's fingerprint."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> CompiledGrammar | None:
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return grammar

    def put(self, key: Hashable, grammar: CompiledGrammar) -> None:
        with self._lock:
            self._entries[key] = grammar
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass
class _Flight:
    """One compile in progress and how many callers still wait for it."""

    future: concurrent.futures.Future
    waiters: int = 0


class GrammarCompiler:
    """Compiles specs for one tokenizer. Construction builds xgrammar's tokenizer info (~1 s for
    a 50k vocabulary): do it once per model, in a thread, at startup."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int],
                 config: GrammarConfig = GrammarConfig(), cache: GrammarCache | None = None
                 ) -> None:
        """``vocab_size``: the model's logits width, which may exceed ``len(tokenizer)`` (padded
        embeddings); ids past the tokenizer are never allowed. ``stop_token_ids``: the model's
        EOS ids, the tokens that may end a complete output."""
        if not stop_token_ids:
            raise ValueError("a grammar needs at least one stop token id (the model's EOS)")
        self.config = config
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.tokenizer_key = tokenizer_fingerprint(tokenizer, vocab_size, self.stop_token_ids)
        self._info = _tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        # Our cache replaces xgrammar's own (whose bound is in bytes and whose keys we cannot see).
        self._xgr = xgr.GrammarCompiler(self._info, max_threads=config.threads_per_compile,
                                        cache_enabled=False)
        self._options = ("ws", config.max_whitespace_chars)
        self.cache = cache if cache is not None else GrammarCache(config.max_cached_grammars)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrent_compiles, thread_name_prefix="grammar-compile")
        self._flights: dict[Hashable, _Flight] = {}
        # Reentrant: a future that is already done runs its done-callback (_land) at once, inside
        # _join's critical section.
        self._lock = threading.RLock()

    def key(self, spec: StructuredOutputSpec) -> Hashable:
        return (self.tokenizer_key, self._options, spec)

    async def compile(self, spec: StructuredOutputSpec, *, timeout_s: float | None = None
                      ) -> CompiledGrammar:
        """The compiled grammar for ``spec``, from the cache or compiled on the pool. Raises
        InvalidRequestError (naming ``spec.param``) if it does not compile or takes longer than
        ``timeout_s`` (default: the config's)."""
        key = self.key(spec)
        if (hit := self.cache.get(key)) is not None:
            return hit
        timeout_s = self.config.compile_timeout_s if timeout_s is None else timeout_s
        flight = self._join(key, spec)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future = loop.create_future()
        flight.future.add_done_callback(lambda f: _resolve_threadsafe(loop, waiter, f))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise _too_slow(spec, timeout_s) from None
        except _CompileError as e:
            raise e.for_request(spec) from None
        finally:
            self._leave(key, flight)

    def compile_blocking(self, spec: StructuredOutputSpec, *, timeout_s: float | None = None
                         ) -> CompiledGrammar:
        """:meth:`compile` for a caller that may block (offline use, tests); same cache and
        sharing."""
        key = self.key(spec)
        if (hit := self.cache.get(key)) is not None:
            return hit
        timeout_s = self.config.compile_timeout_s if timeout_s is None else timeout_s
        flight = self._join(key, spec)
        try:
            return flight.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise _too_slow(spec, timeout_s) from None
        except _CompileError as e:
            raise e.for_request(spec) from None
        finally:
            self._leave(key, flight)

    def num_waiting(self, spec: StructuredOutputSpec) -> int:
        """Callers waiting for ``spec``'s compile now (0 when none is in progress)."""
        with self._lock:
            flight = self._flights.get(self.key(spec))
            return flight.waiters if flight is not None else 0

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU int32 bitmask for ``num_rows`` logits rows of this model's width."""
        return allocate_bitmask(num_rows, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ compile pool

    def _join(self, key: Hashable, spec: StructuredOutputSpec) -> _Flight:
        with self._lock:
            flight = self._flights.get(key)
            if flight is None:
                flight = _Flight(self._pool.submit(self._compile_to_cache, key, spec))
                self._flights[key] = flight
                flight.future.add_done_callback(lambda _f: self._land(key, flight))
            flight.waiters += 1
            return flight

    def _leave(self, key: Hashable, flight: _Flight) -> None:
        with self._lock:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.future.done():
                # Nobody waits any more: drop it if it has not started (a started compile runs
                # on and its result is cached).
                if flight.future.cancel() and self._flights.get(key) is flight:
                    del self._flights[key]

    def _land(self, key: Hashable, flight: _Flight) -> None:
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]

    def _compile_to_cache(self, key: Hashable, spec: StructuredOutputSpec) -> CompiledGrammar:
        grammar = CompiledGrammar(spec, self._compile_now(spec), self.vocab_size)
        self.cache.put(key, grammar)
        return grammar

    def _compile_now(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The xgrammar call itself, on a pool thread. Its errors are the client's (a schema,
        regex or grammar that does not compile); each waiter turns one into a 400 naming its own
        request's field."""
        kind = spec.kind
        try:
            if kind is StructuredOutputKind.JSON_SCHEMA:
                return self._xgr.compile_json_schema(
                    spec.source, strict_mode=spec.strict, any_whitespace=True,
                    max_whitespace_cnt=self.config.max_whitespace_chars)
            if kind is StructuredOutputKind.JSON_OBJECT:
                return self._xgr.compile_json_schema(
                    '{"type":"object"}', strict_mode=False, any_whitespace=True,
                    max_whitespace_cnt=self.config.max_whitespace_chars)
            if kind is StructuredOutputKind.REGEX:
                return self._xgr.compile_regex(spec.source)
            if kind is StructuredOutputKind.GRAMMAR:
                return self._xgr.compile_grammar(spec.source)
            if kind is StructuredOutputKind.CHOICE:
                return self._xgr.compile_structural_tag(choice_structural_tag(spec.choices))
            return self._xgr.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError,
                xgr.InvalidStructuralTagError) as e:
            raise _CompileError(f"{_WHAT[kind]} does not compile: {_first_line(e)}") from None


class _CompileError(Exception):
    """A spec xgrammar refused, shared by every caller waiting for that compile."""

    def for_request(self, spec: StructuredOutputSpec) -> InvalidRequestError:
        return InvalidRequestError(f"{spec.param}: {self}", param=spec.param)


# ---------------------------------------------------------------------------- helpers

def choice_structural_tag(choices: Sequence[str]) -> str:
    """Exactly one of ``choices``, as literal text (no escaping to get wrong)."""
    return json.dumps({"type": "structural_tag", "format": {
        "type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}})


def _tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
                    ) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens (chat markers such
    as ``<|im_start|>``, ``<file_sep>``) made unusable inside constrained output. xgrammar only
    treats tokens that decode to nothing as special; SmolLM2's decode to their markup, which a
    JSON string would otherwise accept. Stop tokens stay allowed where the output may end."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    special_ids = set(getattr(tokenizer, "all_special_ids", ()))
    special_ids |= {i for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(added, "special", False)}
    if not special_ids:
        return detected
    encoded_vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special_ids:
            encoded_vocab[token_id] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded_vocab, detected.dump_metadata())


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> str:
    """Identifies what a compiled grammar depends on: the vocabulary (ids and token strings), the
    logits width and the stop tokens. Two tokenizer objects loaded from one model agree."""
    digest = hashlib.sha256()
    digest.update(f"{type(tokenizer).__name__}|{vocab_size}|{list(stop_token_ids)}|".encode())
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future,
                        future: concurrent.futures.Future) -> None:
    """Hand a pool result to an asyncio waiter; the waiter's loop may be gone (a caller that
    timed out long ago), in which case there is no one to tell."""
    def transfer() -> None:
        if waiter.done():
            return
        if future.cancelled():
            waiter.cancel()
        elif future.exception() is not None:
            waiter.set_exception(future.exception())
        else:
            waiter.set_result(future.result())
    try:
        loop.call_soon_threadsafe(transfer)
    except RuntimeError:  # the loop is closed
        pass


def _too_slow(spec: StructuredOutputSpec, timeout_s: float) -> InvalidRequestError:
    return InvalidRequestError(
        f"{spec.param}: {_WHAT[spec.kind]} took longer than {timeout_s:g} s to compile; "
        "simplify it", param=spec.param)


def _first_line(error: BaseException) -> str:
    """xgrammar's C++ errors read ``[time] /path/file.cc:123: message``; keep the message."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    if text.startswith("[") and ".cc:" in text:
        text = text.split(".cc:", 1)[1].split(": ", 1)[-1]
    return text
