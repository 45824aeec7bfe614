"""Constrained decoding on xgrammar: compile a spec once, then mask each sequence's logits row.

Three pieces, each usable on its own:

- :class:`GrammarCompiler` turns a :class:`~.structured_output.StructuredOutputSpec` into a
  :class:`CompiledGrammar` for one tokenizer. Compiling (building the per-token mask cache) takes
  tens of milliseconds to seconds and cannot be interrupted, so each compile runs in a grammar
  process (:mod:`.grammar_process`) driven by one of a few pool threads, never on the caller's
  thread. A compile that outlasts the time limit is refused with an
  :class:`~llmplatform.errors.InvalidRequestError` (a 400) and its process is killed: it stops
  using CPU at once, and its pool slot is free for the next grammar. A new grammar is then
  *probed* in the same process: its first masks are timed on the path that grows an ambiguous
  grammar's parser fastest, and a grammar with a mask slower than the per-token budget, or whose
  output no token can start, is refused (a 400) before any engine sees it. The result lands in an
  LRU (:class:`GrammarCache`) bounded in bytes and entries, keyed by (tokenizer fingerprint,
  compile options, spec); a grammar bigger than ``max_grammar_bytes`` is refused. Concurrent
  requests for one key share one compile; each tenant has at most ``max_compiles_per_tenant``
  compiles of its own in flight, so one API key cannot hold every slot.
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
import contextlib
import functools
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Hashable, Sequence

import torch
import xgrammar as xgr

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.grammar_cache import GrammarCache
from llmplatform.sampling.grammar_compile import CompileProcesses, CompileRefused
from llmplatform.sampling.grammar_matcher import (
    SequenceGrammar, allocate_bitmask, apply_bitmask, fill_bitmasks,
)
from llmplatform.sampling.grammar_vocab import tokenizer_fingerprint, tokenizer_info
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


MiB = 1024 * 1024


@dataclass(frozen=True)
class GrammarConfig:
    """The grammar compiler's section of the config."""

    max_cached_grammars: int = 256  # compiled grammars kept (LRU), at most
    # ... and their size in bytes (xgrammar's own count plus the serialized copy), at most.
    max_cache_bytes: int = 128 * MiB
    # One grammar's size, at most: a bigger one is refused (a 400). 1,000 long guided_choice
    # strings compile to about 40 MiB; ordinary JSON schemas and tool sets to well under 2 MiB.
    max_grammar_bytes: int = 16 * MiB
    compile_timeout_s: float = 10.0  # a request whose grammar takes longer gets a 400
    max_concurrent_compiles: int = 2  # grammar processes compiling at once; further compiles queue
    max_compiles_per_tenant: int = 1  # compiles of one tenant (API key) in flight at once
    # The longest one output token's mask may take to compute. The probe refuses a grammar that
    # is slower on its first tokens; the engine fails a request that is slower later on.
    token_budget_s: float = 0.25
    probe_tokens: int = 16  # tokens the probe walks through a new grammar
    # Longest run of whitespace a JSON output may contain between tokens; None: unbounded.
    # Small models left free tend to emit newlines forever inside an open object.
    max_whitespace_chars: int | None = 16

    def __post_init__(self) -> None:
        if self.max_cached_grammars < 1:
            raise ValueError("max_cached_grammars must be >= 1")
        if self.max_cache_bytes < 1 or self.max_grammar_bytes < 1:
            raise ValueError("max_cache_bytes and max_grammar_bytes must be >= 1")
        if not self.compile_timeout_s > 0 or not self.token_budget_s > 0:
            raise ValueError("compile_timeout_s and token_budget_s must be > 0")
        if self.max_concurrent_compiles < 1 or self.max_compiles_per_tenant < 1:
            raise ValueError("max_concurrent_compiles and max_compiles_per_tenant must be >= 1")
        if self.probe_tokens < 1:
            raise ValueError("probe_tokens must be >= 1")
        if self.max_whitespace_chars is not None and self.max_whitespace_chars < 1:
            raise ValueError("max_whitespace_chars must be >= 1 or None")


_grammar_ids = itertools.count(1)
# The longest a compile waits for the compile processes' first start (the fork server imports
# torch and xgrammar: seconds) before its own time limit starts.
_WARM_UP_LIMIT_S = 120.0


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer; immutable and shared by every sequence using it.

    It is kept serialized: the engine's matchers live in a grammar process, which gets this
    text; ``handle`` (an xgrammar object in this process) is built only for a caller that walks
    the grammar here (the hf backend, offline tools)."""

    spec: StructuredOutputSpec
    serialized: str  # xgrammar's JSON of the compiled grammar
    memory_size_bytes: int  # xgrammar's size of the compiled grammar
    vocab_size: int  # the logits width the bitmask covers
    tokenizer_info: Any = field(repr=False)  # xgr.TokenizerInfo, to rebuild ``handle``
    tokenizer_info_json: str = field(repr=False)  # the same, for a grammar process
    token_budget_s: float = GrammarConfig.token_budget_s  # the mask time it was admitted under
    grammar_id: int = field(default_factory=lambda: next(_grammar_ids))

    @property
    def size_bytes(self) -> int:
        """What keeping it costs: the compiled grammar and its serialized text."""
        return self.memory_size_bytes + len(self.serialized)

    @functools.cached_property
    def handle(self) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(self.serialized, self.tokenizer_info)

    def new_matcher(self, *, stop_token_ids: Sequence[int] | None = None) -> SequenceGrammar:
        """A matcher in this process (see :class:`.grammar_sandbox.GrammarSandbox` for one that
        cannot hold up its caller)."""
        return SequenceGrammar(self, stop_token_ids=stop_token_ids)


@dataclass
class _TenantSlot:
    """A tenant's compile slots, and how many callers hold or await one."""

    semaphore: asyncio.Semaphore
    users: int = 0


@dataclass
class _Flight:
    """One compile in progress and how many callers still wait for it."""

    future: concurrent.futures.Future
    waiters: int = 0


class GrammarCompiler:
    """Compiles specs for one tokenizer. Construction builds xgrammar's tokenizer info (~1 s for
    a 50k vocabulary): do it once per model, in a thread, at startup. Grammar processes start on
    the first compile."""

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
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, self.stop_token_ids)
        # What each grammar process is given at start (our cache replaces xgrammar's own).
        self.tokenizer_info_json = self.tokenizer_info.serialize_json()
        self._options = ("ws", config.max_whitespace_chars)
        self.cache = cache if cache is not None else GrammarCache(config.max_cached_grammars,
                                                                  config.max_cache_bytes)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrent_compiles, thread_name_prefix="grammar-compile")
        self._processes = CompileProcesses(self.tokenizer_info_json,
                                           num_processes=config.max_concurrent_compiles,
                                           pool=self._pool)
        self._flights: dict[Hashable, _Flight] = {}
        # Reentrant: a future that is already done runs its done-callback (_land) at once, inside
        # _join's critical section.
        self._lock = threading.RLock()
        self._tenants: dict[str, _TenantSlot] = {}

    def key(self, spec: StructuredOutputSpec) -> Hashable:
        return (self.tokenizer_key, self._options, spec)

    async def compile(self, spec: StructuredOutputSpec, *, timeout_s: float | None = None,
                      tenant: str | None = None) -> CompiledGrammar:
        """The compiled grammar for ``spec``, from the cache or compiled on the pool. Raises
        InvalidRequestError (naming ``spec.param``) if it does not compile, fails its probe or
        takes longer than ``timeout_s`` (default: the config's), waiting included. ``tenant``:
        who asks (an API key's id); a tenant's own compiles beyond ``max_compiles_per_tenant``
        wait for its earlier ones, not for the pool."""
        key = self.key(spec)
        if (hit := self.cache.get(key)) is not None:
            return hit
        timeout_s = self.config.compile_timeout_s if timeout_s is None else timeout_s
        warm = self._processes.warm
        if not warm.done():  # waiters resume in arrival order
            await asyncio.wait([asyncio.wrap_future(warm)], timeout=_WARM_UP_LIMIT_S)
        deadline = time.monotonic() + timeout_s
        try:
            async with self._tenant_slot(tenant, timeout_s):
                if (hit := self.cache.get(key)) is not None:
                    return hit
                return await self._compile_async(key, spec, deadline)
        except TimeoutError:
            raise _too_slow(spec, timeout_s) from None

    @contextlib.asynccontextmanager
    async def _tenant_slot(self, tenant: str | None, timeout_s: float) -> AsyncIterator[None]:
        """One of ``tenant``'s compile slots (None: no tenant, no wait). A tenant's entry lives
        while someone holds or awaits one of its slots."""
        if tenant is None:
            yield
            return
        slot = self._tenants.get(tenant)
        if slot is None:
            slot = self._tenants[tenant] = _TenantSlot(
                asyncio.Semaphore(self.config.max_compiles_per_tenant))
        slot.users += 1
        try:
            await asyncio.wait_for(slot.semaphore.acquire(), timeout_s)
            try:
                yield
            finally:
                slot.semaphore.release()
        finally:
            slot.users -= 1
            if slot.users == 0:
                del self._tenants[tenant]

    async def _compile_async(self, key: Hashable, spec: StructuredOutputSpec, deadline: float
                             ) -> CompiledGrammar:
        flight = self._join(key, spec)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future = loop.create_future()
        flight.future.add_done_callback(lambda f: _resolve_threadsafe(loop, waiter, f))
        try:
            return await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
        except CompileRefused as e:
            raise _refused(spec, e) from None
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
        self.wait_warm(_WARM_UP_LIMIT_S)
        flight = self._join(key, spec)
        try:
            return flight.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise _too_slow(spec, timeout_s) from None
        except CompileRefused as e:
            raise _refused(spec, e) from None
        finally:
            self._leave(key, flight)

    def wait_warm(self, timeout_s: float) -> bool:
        """Block until the compile processes have started (or failed to); False on timeout."""
        return not concurrent.futures.wait([self._processes.warm], timeout_s).not_done

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
        self._processes.close()

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
                # on, within its own deadline, and its result is cached).
                if flight.future.cancel() and self._flights.get(key) is flight:
                    del self._flights[key]

    def _land(self, key: Hashable, flight: _Flight) -> None:
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]

    def _compile_to_cache(self, key: Hashable, spec: StructuredOutputSpec) -> CompiledGrammar:
        grammar = self._compile_now(spec)
        if grammar.size_bytes > self.config.max_grammar_bytes:
            raise CompileRefused(
                f"is too large: it compiles to {grammar.size_bytes / MiB:.1f} MiB, over the "
                f"limit of {self.config.max_grammar_bytes / MiB:g} MiB per grammar; simplify it")
        self.cache.put(key, grammar)
        return grammar

    def _compile_now(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compile and probe, in a compile process killed at its deadlines. Its refusals
        are the client's (a schema, regex or grammar that does not compile, or that fails the
        probe); each waiter turns one into a 400 naming its own field."""
        kind, config = spec.kind, self.config
        source = (choice_structural_tag(spec.choices) if kind is StructuredOutputKind.CHOICE
                  else spec.source)
        _, serialized, memory_size_bytes, _probe_s = self._processes.compile(
            ("compile", kind.value, source, spec.strict, config.max_whitespace_chars,
             config.probe_tokens, config.token_budget_s, config.max_grammar_bytes, spec.after),
            compile_timeout_s=config.compile_timeout_s, token_budget_s=config.token_budget_s)
        return CompiledGrammar(spec, serialized, memory_size_bytes, self.vocab_size,
                               self.tokenizer_info, self.tokenizer_info_json,
                               config.token_budget_s)


def _refused(spec: StructuredOutputSpec, refusal: CompileRefused) -> InvalidRequestError:
    """A compile's refusal as this request's 400, naming its own field."""
    return InvalidRequestError(f"{spec.param}: {_WHAT[spec.kind]} {refusal}", param=spec.param)


# ---------------------------------------------------------------------------- helpers

def choice_structural_tag(choices: Sequence[str]) -> str:
    """Exactly one of ``choices``, as literal text (no escaping to get wrong)."""
    return json.dumps({"type": "structural_tag", "format": {
        "type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}})


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
