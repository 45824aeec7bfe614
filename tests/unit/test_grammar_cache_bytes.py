"""The compiled-grammar cache is bounded in bytes as well as entries (xgrammar's size of each
grammar plus its serialized text), evicting the least recently used."""

from __future__ import annotations

from llmplatform.sampling.grammar import CompiledGrammar, GrammarCache
from llmplatform.sampling.structured_output import StructuredOutputSpec


def grammar(name: str, num_bytes: int) -> CompiledGrammar:
    # Half xgrammar's count, half the serialized text: size_bytes adds both.
    return CompiledGrammar(StructuredOutputSpec.regex(name), "x" * (num_bytes // 2),
                           num_bytes - num_bytes // 2, vocab_size=8, tokenizer_info=None,
                           tokenizer_info_json="")


def test_eviction_keeps_the_cache_within_its_byte_bound():
    cache = GrammarCache(max_entries=100, max_bytes=1000)
    for i in range(10):
        cache.put(i, grammar(f"g{i}", 300))
        assert cache.num_bytes <= 1000
    assert len(cache) == 3 and cache.num_bytes == 900
    assert all(i in cache for i in (7, 8, 9))
    cache.get(7)  # most recently used now
    cache.put(10, grammar("g10", 300))
    assert 7 in cache and 8 not in cache and cache.num_bytes == 900


def test_a_grammar_bigger_than_the_whole_cache_is_not_kept():
    cache = GrammarCache(max_entries=100, max_bytes=1000)
    cache.put("small", grammar("small", 100))
    cache.put("huge", grammar("huge", 5000))
    assert "huge" not in cache and "small" in cache and cache.num_bytes == 100


def test_replacing_an_entry_counts_its_bytes_once():
    cache = GrammarCache(max_entries=100, max_bytes=1000)
    cache.put("a", grammar("a", 400))
    cache.put("a", grammar("a", 500))
    assert len(cache) == 1 and cache.num_bytes == 500
