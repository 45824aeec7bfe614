"""What cache_aware matches: route hints and the approximate prefix tree of each worker.

**What is matched: an approximate prefix tree per worker, built from this router's own picks.**
The request's routing text (the gateway's rendering of the prompt: the completion prompt, or the
chat messages serialized in order: the gateway's ``openai_api/worker_routing.py``) is cut into
``CHUNK_CHARS``-character chunks, and each full chunk is named by a hash chained from the previous
one (:func:`prefix_hashes`), exactly as the engine names KV blocks: equal hashes mean equal
prefixes. Each worker's tree is the set of chain hashes of the prompts routed to it; a request's
match on a worker is how many of its leading hashes that set holds. Why this and not the
alternative, block-hash sets that workers report in their heartbeats:

- the engine's block hashes are over token ids; matching them needs the model's tokenizer at the
  controller (which holds no model) and a reported set per heartbeat (thousands of hashes per
  worker every few seconds);
- a heartbeat is seconds old exactly when it matters: a burst of requests with a new system
  prompt all arrive before any worker has reported it, and would all be spread by load. A tree
  updated at the pick knows where the prefix went from the first request on;
- it works for any worker (hf, stock FastChat), and the controller and a gateway routing
  locally run the same code (this package) over the same hint.

What it gives up is exactness: the tree does not see a worker evict blocks. Entries therefore
age out (``entry_ttl_s`` since last routed), each tree is bounded (``max_chunks_per_worker``,
least recently routed chunks dropped first, leaves before their roots), and a worker whose
cache is known to be gone is forgotten: a new process at its address, or a prefix-cache reset it
reported (both change its ``cache_epoch``).

A ``cache_salt`` seeds a chain (and namespaces a session key), as it seeds the engine's block
hashes: a prompt salted for one tenant matches nothing of another's.

The decision made from a match is ``routing.cache_aware``'s.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK_CHARS = 64
"""Characters per hashed chunk of routing text (~16 tokens: the engine's default block)."""
MAX_ROUTE_CHUNKS = 512
"""The most chunks of a prompt matched and recorded (32k characters, ~8k tokens): what a hint
carries over the wire at most. Two prompts equal that far are routed as one."""


def prefix_hashes(text: str, *, max_chunks: int = MAX_ROUTE_CHUNKS,
                  cache_salt: str | None = None) -> tuple[int, ...]:
    """The chain hashes of `text`'s full `CHUNK_CHARS` chunks (a partial last chunk is not
    hashed: like a partial KV block, it is never shared). Stable across processes (BLAKE2b, not
    `hash()`), 63-bit so every JSON peer reads them exactly. A `cache_salt` seeds the chain, as
    it seeds the engine's: a prompt salted differently matches nothing of it, so one tenant's
    guess is never steered to the worker holding another's prefix."""
    hashes: list[int] = []
    parent = b"" if cache_salt is None else _salt_root(cache_salt)
    for start in range(0, min(len(text), max_chunks * CHUNK_CHARS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        digest = hashlib.blake2b(parent + text[start:start + CHUNK_CHARS].encode(),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big") >> 1)
        parent = digest
    return tuple(hashes)


def _salt_root(cache_salt: str) -> bytes:
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8,
                           person=b"llmp-cache-salt").digest()


def session_hash(key: str) -> int:
    """What a session key travels as (the controller never needs the user's id itself)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8,
                                          person=b"llmp-session").digest(), "big") >> 1


@dataclass(frozen=True)
class RouteHint:
    """What cache_aware needs to know of one request (other policies ignore it)."""

    prefix_hashes: tuple[int, ...] = ()
    session: int | None = None

    @classmethod
    def of(cls, text: str | None, session_key: str | None = None,
           cache_salt: str | None = None) -> RouteHint:
        """The hint of a prompt and session; with `cache_salt`, both live in the salt's own
        namespace (another salt's prefixes and sessions never match)."""
        if session_key and cache_salt is not None:
            session_key = f"{cache_salt}\0{session_key}"
        return cls(prefix_hashes(text, cache_salt=cache_salt) if text else (),
                   session_hash(session_key) if session_key else None)


NO_HINT = RouteHint()


class PrefixTree:
    """One worker's chain hashes, least recently routed first."""

    def __init__(self, epoch: str | None) -> None:
        self.epoch = epoch
        self.routed_at: OrderedDict[int, float] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` are held (call `expire` first)."""
        count = 0
        for chunk_hash in hashes:
            if chunk_hash not in self.routed_at:
                break
            count += 1
        return count

    def insert(self, hashes: Sequence[int], now: float, max_chunks: int) -> None:
        # Leaves first, root last: the root ends most recent, so eviction (oldest first) takes
        # a chain's tail before its head, and what is left is still a prefix that matches.
        for chunk_hash in reversed(hashes):
            self.routed_at[chunk_hash] = now
            self.routed_at.move_to_end(chunk_hash)
        while len(self.routed_at) > max_chunks:
            self.routed_at.popitem(last=False)

    def expire(self, oldest: float) -> None:
        while self.routed_at:
            chunk_hash, routed_at = next(iter(self.routed_at.items()))
            if routed_at >= oldest:
                return
            del self.routed_at[chunk_hash]
