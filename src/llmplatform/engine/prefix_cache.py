"""Prefix caching's bookkeeping: which KV blocks hold which full blocks of tokens.

A full block of ``block_size`` tokens is identified by a hash chained from its parent block's
hash, so equal hashes mean equal *prefixes*, not merely equal blocks::

    tokens     [t0 .. t3] [t4 .. t7] [t8 .. t11] [t12 t13]       block_size = 4
    hashes     h0         h1         h2          (partial: never hashed, never cached)
    h0 = H(None, t0..t3)   h1 = H(h0, t4..t7)   h2 = H(h1, t8..t11)

``H`` is SHA-256 over the parent's 32-byte digest (nothing for the first block) followed by the
token ids as little-endian int64: stable across processes and machines (unlike ``hash()`` of
``bytes``), and wide enough that a collision, which would silently reuse another prefix's KV, is
not a practical concern, so token ids are not stored for verification.

A request's ``cache_salt`` (vLLM's field; the gateway sets one per API key with
``--prefix-cache-isolation per-key``) stands in for the first block's missing parent
(:func:`salt_root`): every hash of a salted sequence is chained from it, so sequences with
different salts (or one salted and one not) never share a cached block, however equal their
tokens. The shared prefix cache would otherwise be a timing oracle between tenants: a prompt
answered faster than its length explains was cached, i.e. someone sent it before.

:class:`PrefixCache` maps hashes to the pool's block ids, one block per hash, and back. It knows
nothing of reference counts or of the free pool: the block manager decides when a block is
registered (it became full and computed), when it is dropped (it is evicted, i.e. reallocated)
and which hits a sequence may take. Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A block's chained hash: a SHA-256 digest (32 bytes).
BlockHash = bytes


def salt_root(cache_salt: str | None, lora_id: int | None = None) -> BlockHash | None:
    """The parent a salted sequence's first block is hashed with (None: unsalted, base model).
    Domain-separated, so no salt's root equals any block's hash. A LoRA adapter's id (unique per
    load: ``engine.lora``) salts it too: the KV of a prefix depends on the adapter that computed
    it, so sequences of different adapters (or of an adapter and the base model) share none."""
    salt = None if cache_salt is None else cache_salt.encode("utf-8", "surrogatepass")
    if lora_id is None:
        return None if salt is None else hashlib.sha256(b"llmplatform-cache-salt\0" + salt).digest()
    # Its own domain, the fixed-width id first: no (salt, adapter) pair's input equals another's.
    return hashlib.sha256(b"llmplatform-lora-salt\0" + struct.pack("<q", lora_id)
                          + (b"" if salt is None else b"\1" + salt)).digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block of ``token_ids`` whose preceding block hashed to ``parent``
    (for a sequence's first block: ``salt_root`` of its salt, ``None`` when unsalted)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Cumulative counters (they survive a reset, like any monotonic counter).

    A *query* is one admission that looked up its longest cached prefix; ``num_queried_tokens``
    adds that sequence's tokens, ``num_hit_tokens`` the tokens its cached blocks covered (so
    hits / queries is the fraction of admitted tokens that were not recomputed).
    """

    num_queries: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_blocks: int = 0
    num_resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class PrefixCache:
    """A one-to-one map between cached hashes and block ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        self._block_of_hash: dict[BlockHash, int] = {}
        self._hash_of_block: list[BlockHash | None] = [None] * num_blocks

    def __len__(self) -> int:
        """Blocks cached now (in use or free)."""
        return len(self._block_of_hash)

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of_block[block_id]

    def longest_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids holding ``hashes[0], hashes[1], ...``, up to the first hash not cached."""
        block_ids = []
        for block_hash in hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Cache ``block_id`` as holding ``block_hash``. False (and nothing changes) when another
        block already holds that hash: the first block computed for a prefix stays its one copy,
        the duplicate is an ordinary block."""
        current = self._hash_of_block[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} is cached with another hash"
            return True
        if block_hash in self._block_of_hash:
            return False
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        return True

    def drop(self, block_id: int) -> bool:
        """Forget ``block_id``'s hash (its KV is about to be overwritten). True if it had one."""
        block_hash = self._hash_of_block[block_id]
        if block_hash is None:
            return False
        del self._block_of_hash[block_hash]
        self._hash_of_block[block_id] = None
        return True

    def clear(self) -> None:
        self._block_of_hash.clear()
        self._hash_of_block = [None] * len(self._hash_of_block)

    def check_invariants(self) -> None:
        """Assert the two directions of the map agree."""
        cached = {b: h for b, h in enumerate(self._hash_of_block) if h is not None}
        assert {h: b for b, h in cached.items()} == self._block_of_hash, "hash map out of sync"
