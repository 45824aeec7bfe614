"""cache_salt in the block manager: a salt seeds the first block's hash, so sequences with
different salts (or salted and unsalted) never share cached blocks, while the same salt does."""

from __future__ import annotations

import hashlib
import itertools
import struct

from llmplatform.engine.block_manager import BlockManager
from llmplatform.engine.prefix_cache import hash_block_tokens, salt_root
from llmplatform.engine.sequence import Sequence
from llmplatform.sampling.params import SamplingParams

_ids = itertools.count()
PROMPT = list(range(200, 213))  # 13 tokens: three full blocks of 4 and a partial one


def make_seq(salt: str | None) -> Sequence:
    return Sequence(f"salted-{next(_ids)}", list(PROMPT), SamplingParams(), cache_salt=salt)


def run_and_free(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq` (taking its cached prefix), compute it all, register its blocks, free it."""
    cached = bm.find_cached_prefix(seq, seq.num_tokens - 1)
    bm.take_cached_prefix(seq, cached)
    bm.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    bm.free(seq)


def test_a_salt_changes_every_block_hash_and_the_same_salt_keeps_them() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    plain, a, a_again, b = make_seq(None), make_seq("tenant-a"), make_seq("tenant-a"), make_seq("tenant-b")
    for seq in (plain, a, a_again, b):
        bm.find_cached_prefix(seq, seq.num_tokens)  # fills the sequence's hash memo
    assert len(plain.block_hashes) == 3
    # Unsalted hashes are unchanged (pinned by test_prefix_caching's chain test).
    assert plain.block_hashes[0] == hashlib.sha256(struct.pack("<4q", *PROMPT[:4])).digest()
    # The salt is the first block's parent, so the whole chain differs, block by block.
    assert a.block_hashes[0] == hash_block_tokens(salt_root("tenant-a"), PROMPT[:4])
    for i in range(3):
        assert len({plain.block_hashes[i], a.block_hashes[i], b.block_hashes[i]}) == 3
    assert a.block_hashes == a_again.block_hashes
    # The salt's root is domain-separated: no salt stands in for a block (or for no salt).
    assert salt_root(None) is None and salt_root("") != hash_block_tokens(None, [])


def test_another_salt_gets_no_hit_the_same_salt_does() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    run_and_free(bm, make_seq("tenant-a"))
    stats = bm.prefix_cache_stats
    assert bm.num_cached_blocks == 3

    for other in (make_seq("tenant-b"), make_seq(None)):
        assert bm.find_cached_prefix(other, other.num_tokens - 1) == []

    same = make_seq("tenant-a")
    cached = bm.find_cached_prefix(same, same.num_tokens - 1)
    assert len(cached) == 3
    bm.take_cached_prefix(same, cached)
    assert stats.num_hit_tokens == 12 and same.num_computed_tokens == 12
    bm.free(same)

    # An unsalted run next to the salted one caches its own copy: both survive.
    run_and_free(bm, make_seq(None))
    assert bm.num_cached_blocks == 6
    bm.check_invariants([])


def test_forked_children_share_their_parents_salted_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    parent, child = make_seq("tenant-a"), make_seq("tenant-a")
    bm.allocate_slots(parent, parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    bm.cache_full_blocks(parent)
    bm.fork(parent, child)
    assert child.block_hashes == parent.block_hashes[:3]
    bm.check_invariants([parent, child])
