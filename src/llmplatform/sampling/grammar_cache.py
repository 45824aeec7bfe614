"""The compiled-grammar cache: an LRU bounded in entries and in bytes (see :mod:`.grammar`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from llmplatform.sampling.grammar import CompiledGrammar


class GrammarCache:
    """A thread-safe LRU of compiled grammars, bounded by entry count and by bytes
    (:attr:`CompiledGrammar.size_bytes`). One cache may be shared by several compilers: keys
    start with the tokenizer's fingerprint."""

    def __init__(self, max_entries: int, max_bytes: int | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.num_bytes = 0
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
            if (old := self._entries.pop(key, None)) is not None:
                self.num_bytes -= old.size_bytes
            if self.max_bytes is not None and grammar.size_bytes > self.max_bytes:
                return  # would evict everything and still not fit
            self._entries[key] = grammar
            self.num_bytes += grammar.size_bytes
            while len(self._entries) > self.max_entries or (
                    self.max_bytes is not None and self.num_bytes > self.max_bytes):
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.size_bytes

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
