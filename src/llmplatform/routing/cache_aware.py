"""cache_aware dispatch: send a request to the worker that most likely holds its prompt's prefix.

A paged worker keeps the KV blocks of prompts it served (engine/prefix_cache.py) and reuses them
for any later prompt that starts the same way. Routing by load alone scatters a long system
prompt, or a conversation's turns, over every worker, and each one prefills it again.

**What is matched** (``routing.prefix_tree``): an approximate prefix tree per worker, built
from this router's own picks. A request's routing text is cut into chunks named by chained
hashes, as the engine names KV blocks; a worker's tree holds the chains routed to it, and a
request's match on a worker is how many of its leading hashes that tree holds. Entries age out,
trees are bounded, and a worker whose cache is known gone is forgotten (see that module for why
this and not block hashes reported by workers).

**The decision.** The worker with the longest match wins (ties: least_load among them). A
session key (``RouteHint.session``) is stickier still: while the session's last worker is a
candidate it is preferred over any match. Either preference yields to load: when the preferred
worker has more than ``balance_threshold`` outstanding requests more than the worker least_load
would pick (or its KV cache is under pressure and that one's is not), least_load decides
(``load_override``). A cold prefix (one with at most 1/N of the recent requests over N
candidates) stays with its worker longer, up to ``cold_balance_threshold``: moving it means
computing it again elsewhere, and one worker can serve it. A hot one needs more than one worker:
while fewer workers hold it than its share fills (``ceil(share x N)``), a request goes to the
least loaded worker without it, if that one is no busier (``spread``); among those holding it the
balance threshold applies. A request with no match goes by least_load. Every decision is
recorded: the chosen worker's tree takes the request's chain, the session points at it.

Only workers with a prefix cache take part (:func:`has_prefix_cache`: they report its counters).
Affinity to an hf worker or a stock FastChat one would cost balance and gain nothing: among
those, and for any request where no candidate caches, least_load decides (``no_cache``). That
makes cache_aware a safe default for any cluster.
"""

from __future__ import annotations

import enum
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from llmplatform.routing.prefix_tree import (  # re-exported: the policy's hint types
    CHUNK_CHARS,
    MAX_ROUTE_CHUNKS,
    NO_HINT,
    PrefixTree,
    RouteHint,
    prefix_hashes,
    session_hash,
)

__all__ = [
    "CHUNK_CHARS", "MAX_HEAT_ENTRIES", "MAX_ROUTE_CHUNKS", "NO_HINT", "CacheAwareCandidate",
    "CacheAwareConfig", "CacheAwarePolicy", "Decision", "Reason", "RouteHint", "has_prefix_cache",
    "prefix_hashes", "session_hash",
]


@dataclass(frozen=True)
class CacheAwareConfig:
    """cache_aware's knobs (the controller's flags; a gateway routing locally takes the
    controller's values from `/list_workers`)."""

    balance_threshold: int = 2
    """Outstanding requests the preferred worker may have beyond the least loaded one before
    load decides instead, for a session or a hot prefix (one that gets more than one worker's
    share of the recent requests: it needs more than one worker anyway, and goes to the ones
    that do not hold it yet first, see ``spread``)."""
    cold_balance_threshold: int = 8
    """The same for a cold prefix (at most one worker's share of the recent requests). Moving
    one of its requests computes the whole prefix again on the other worker, which then holds
    it too; waiting costs the queue. On benchmarks/routing.py's shared load (16 prefixes, 8 in
    flight) a threshold of 2 moved 14 of 128 requests, nearly all while their worker was
    prefilling another prefix, and the 16 prefixes were computed 30 times instead of 16."""
    heat_half_life: float = 4.0
    """How fast a prefix's share of the recent requests forgets: its count (and the total)
    halves every ``heat_half_life x N`` requests routed, N the candidate workers. In requests,
    not seconds, so a prefix that turns hot is seen as hot after about as many requests at
    any request rate (~10 with 2 workers; with a 30 s half-life, 40 s of an 80% skew after a
    mixed load were not enough); per worker, so one worker's share (1/N) stays many requests."""
    entry_ttl_s: float = 600.0
    """Seconds after its last routing that a prefix (or a session) is forgotten."""
    max_chunks_per_worker: int = 32768
    """Chunks remembered per worker (x CHUNK_CHARS characters: 2M by default, ~500k tokens)."""
    max_sessions: int = 65536
    """Sessions remembered in all (least recently used dropped first)."""

    def __post_init__(self) -> None:
        if isinstance(self.balance_threshold, bool) or self.balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0 requests, got {self.balance_threshold}")
        if not self.entry_ttl_s > 0:
            raise ValueError(f"entry_ttl_s must be > 0 seconds, got {self.entry_ttl_s}")
        if isinstance(self.cold_balance_threshold, bool) or self.cold_balance_threshold < 0:
            raise ValueError(f"cold_balance_threshold must be >= 0 requests, got {self.cold_balance_threshold}")
        if not self.heat_half_life > 0:
            raise ValueError(f"heat_half_life must be > 0 requests per worker, got {self.heat_half_life}")
        for name in ("max_chunks_per_worker", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Reason(str, enum.Enum):
    """Why a worker was picked (the dispatch metrics' `reason` label, and the debug log)."""

    AFFINITY = "affinity"
    """cache_aware: the longest prefix match."""
    SESSION = "session"
    """cache_aware: the session's worker."""
    LOAD_OVERRIDE = "load_override"
    """cache_aware: a match or session was preferred, but its worker was too loaded."""
    NO_MATCH = "no_match"
    """cache_aware: no worker matched; least_load decided."""
    SPREAD = "spread"
    """cache_aware: a hot prefix sent to a worker that does not hold it yet (its share of the
    recent requests needs more workers than hold it)."""
    NO_CACHE = "no_cache"
    """cache_aware: no candidate has a prefix cache; least_load decided."""
    LOAD = "load"
    """Any other policy: its own ranking."""


class CacheAwareCandidate(Protocol):
    """The facts cache_aware reads of a worker besides least_load's."""

    @property
    def worker_name(self) -> str: ...
    @property
    def cache_epoch(self) -> str | None:
        """Changes when the worker's cache is known gone (new process, reported reset)."""
        ...
    @property
    def prefix_cache_queries(self) -> int | None:
        """None when the worker reports no prefix cache (see :func:`has_prefix_cache`)."""
        ...


def has_prefix_cache(candidate: object) -> bool:
    """Whether a worker reuses cached prompt prefixes: it reports its prefix-cache counters
    (paged workers with prefix caching on). An hf worker, a stock FastChat worker or a paged
    one with ``--no-enable-prefix-caching`` gains nothing from affinity: cache_aware ranks them
    by load alone and keeps no tree for them."""
    return getattr(candidate, "prefix_cache_queries") is not None


W = TypeVar("W")


@dataclass(frozen=True)
class Decision(Generic[W]):
    worker: W
    reason: Reason
    matched_chars: int = 0
    """How much of the prompt the chosen worker is believed to hold."""


C = TypeVar("C")


class CacheAwarePolicy:
    """The cache_aware state (one per router: the controller's, each gateway's) and its pick.

    Pure bookkeeping: no network, no asyncio; the clock and the load ranking are injected (the
    ranking is policies.py's least_load, passed in so this module stays below it).
    """

    def __init__(
        self,
        config: CacheAwareConfig,
        *,
        least_load: Callable[[Sequence[C]], C],
        load_of: Callable[[C], tuple[bool, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._least_load = least_load
        self._load_of = load_of
        self._clock = clock
        self._trees: dict[str, PrefixTree] = {}
        self._sessions: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._heat = _Heat(config.heat_half_life)

    # ---- the pick -----------------------------------------------------------------------------

    def pick(self, candidates: Sequence[C], hint: RouteHint = NO_HINT) -> Decision[C] | None:
        """Choose among `candidates` (each a DispatchCandidate and a CacheAwareCandidate) and
        record the choice; None if there are none."""
        if not candidates:
            return None
        now = self._clock()
        oldest = now - self.config.entry_ttl_s
        caching = [has_prefix_cache(c) for c in candidates]
        balanced = self._least_load(candidates)
        if not any(caching):
            return Decision(balanced, Reason.NO_CACHE)
        trees = [self._tree_of(c, oldest) if cached else None for c, cached in zip(candidates, caching)]
        preferred, reason, matched = self._session_worker(candidates, hint, oldest), Reason.SESSION, 0
        hashes = hint.prefix_hashes
        threshold = self.config.balance_threshold
        if hashes:
            matches = [tree.match(hashes) if tree is not None else 0 for tree in trees]
            matched = max(matches)
            if preferred is None and matched > 0:
                reason = Reason.AFFINITY
                preferred = self._least_load([c for c, m in zip(candidates, matches) if m == matched])
            elif preferred is not None:
                matched = matches[list(candidates).index(preferred)]
            self._heat.record(hashes, len(candidates))
            if reason is Reason.AFFINITY:
                depth = 1 << (matched.bit_length() - 1)  # the depth the share is counted at
                share = self._heat.share(hashes, depth, len(candidates))
                # A prefix (what the request shares with earlier ones) is cold while it has at
                # most one worker's share of the recent requests; a hot one needs as many
                # workers as its share of the recent requests fills.
                if share <= 1 / len(candidates):
                    threshold = self.config.cold_balance_threshold
                else:
                    spread = self._spread_to(candidates, caching, matches, depth, share, preferred)
                    if spread is not None:
                        preferred, reason, matched = spread, Reason.SPREAD, 0
        chosen: C
        if preferred is None:
            chosen, reason, matched = balanced, Reason.NO_MATCH, 0
        elif reason is Reason.SPREAD:
            chosen = preferred
        elif self._too_loaded(preferred, balanced, threshold):
            chosen, reason = balanced, Reason.LOAD_OVERRIDE
            matched = matches[list(candidates).index(balanced)] if hashes else 0
        else:
            chosen = preferred
        if has_prefix_cache(chosen):
            self._record(chosen, hint, now)
        return Decision(chosen, reason, matched * CHUNK_CHARS)

    def _spread_to(self, candidates: Sequence[C], caching: Sequence[bool], matches: Sequence[int],
                   depth: int, share: float, preferred: C) -> C | None:
        """For a hot prefix held by fewer workers than its share of the recent requests needs
        (``ceil(share x N)``), the least loaded caching worker that does not hold it, if it is no
        more loaded than `preferred`: it computes the prefix once and shares the load from then
        on. Waiting for a load override instead leaves the prefix on one worker for as long as
        that worker's requests, cheap since they hit its cache, finish fast enough to keep its
        count of outstanding requests low."""
        holders = sum(1 for m in matches if m >= depth)
        if holders >= math.ceil(share * len(candidates) - 1e-9):
            return None
        others = [c for c, cached, m in zip(candidates, caching, matches) if cached and m < depth]
        if not others:
            return None
        other = self._least_load(others)
        return other if self._least_load([preferred, other]) is other else None

    def _too_loaded(self, preferred: C, balanced: C, threshold: int) -> bool:
        if preferred is balanced:
            return False
        preferred_pressure, preferred_outstanding = self._load_of(preferred)
        balanced_pressure, balanced_outstanding = self._load_of(balanced)
        if preferred_pressure and not balanced_pressure:
            return True
        return preferred_outstanding - balanced_outstanding > threshold

    def _session_worker(self, candidates: Sequence[C], hint: RouteHint, oldest: float) -> C | None:
        if hint.session is None:
            return None
        entry = self._sessions.get(hint.session)
        if entry is None or entry[1] < oldest:
            return None
        return next((c for c in candidates if _name(c) == entry[0] and has_prefix_cache(c)), None)

    def _record(self, chosen: C, hint: RouteHint, now: float) -> None:
        if hint.prefix_hashes:
            self._trees[_name(chosen)].insert(hint.prefix_hashes, now, self.config.max_chunks_per_worker)
        if hint.session is not None:
            self._sessions[hint.session] = (_name(chosen), now)
            self._sessions.move_to_end(hint.session)
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)

    def _tree_of(self, candidate: C, oldest: float) -> PrefixTree:
        """The candidate's tree, new if its cache epoch changed (its old cache is gone)."""
        name, epoch = _name(candidate), getattr(candidate, "cache_epoch")
        tree = self._trees.get(name)
        if tree is None or tree.epoch != epoch:
            self.forget(name)
            tree = self._trees[name] = PrefixTree(epoch)
        tree.expire(oldest)
        return tree

    # ---- upkeep -------------------------------------------------------------------------------

    def forget(self, worker_name: str) -> None:
        """Drop what is known of a worker: its tree and the sessions pointing at it."""
        self._trees.pop(worker_name, None)
        for session in [s for s, (name, _) in self._sessions.items() if name == worker_name]:
            del self._sessions[session]

    def retain(self, worker_names: Collection[str]) -> None:
        """Forget every worker not in `worker_names` (gone from the registry)."""
        for name in [n for n in self._trees if n not in worker_names]:
            self.forget(name)

    def num_chunks(self, worker_name: str) -> int:
        tree = self._trees.get(worker_name)
        return len(tree.routed_at) if tree is not None else 0

    def with_config(self, config: CacheAwareConfig) -> CacheAwarePolicy:
        """This policy with other knobs, keeping what it learned (trimmed lazily)."""
        if config == self.config:
            return self
        policy = CacheAwarePolicy(config, least_load=self._least_load, load_of=self._load_of,
                                  clock=self._clock)
        policy._trees, policy._sessions = self._trees, self._sessions
        policy._heat.counts, policy._heat.total, policy._heat.seq = (
            self._heat.counts, self._heat.total, self._heat.seq)
        return policy


MAX_HEAT_ENTRIES = 65536
"""Prefixes whose share of the recent requests is tracked (least recently seen dropped first)."""


class _Heat:
    """How many recent requests share a prefix: counts that halve every ``half_life x N``
    requests, kept for each request's chain at the power-of-two depths (1, 2, 4, ... chunks), so
    a share is read at any depth (rounded down to one of those) for a few updates per request."""

    def __init__(self, half_life_per_worker: float) -> None:
        self.half_life_per_worker = half_life_per_worker
        self.counts: OrderedDict[int, tuple[float, int]] = OrderedDict()  # chain hash -> (count, seq)
        self.total = (0.0, 0)
        self.seq = 0
        """Requests recorded: the clock the counts decay by."""

    def _decayed(self, entry: tuple[float, int], num_workers: int) -> float:
        count, seq = entry
        return count * 0.5 ** ((self.seq - seq) / (self.half_life_per_worker * num_workers))

    def record(self, hashes: Sequence[int], num_workers: int) -> None:
        self.seq += 1
        self.total = (self._decayed(self.total, num_workers) + 1.0, self.seq)
        depth = 1
        while depth <= len(hashes):
            key = hashes[depth - 1]
            count = self._decayed(self.counts.pop(key, (0.0, self.seq)), num_workers) + 1.0
            self.counts[key] = (count, self.seq)
            depth *= 2
        while len(self.counts) > MAX_HEAT_ENTRIES:
            self.counts.popitem(last=False)

    def share(self, hashes: Sequence[int], depth: int, num_workers: int) -> float:
        """The share of the recent requests that began with ``hashes[:depth]`` (``depth`` >= 1,
        rounded down to a power of two). Until a full window of requests has been seen, the
        share is of a full window: three requests after a start, two of them alike, are not
        yet a hot prefix."""
        entry = self.counts.get(hashes[(1 << (depth.bit_length() - 1)) - 1])
        if entry is None:
            return 0.0
        # The total a steady stream of requests settles at: sum of 2^(-k / (half_life x N)).
        window = 1.0 / (1.0 - 0.5 ** (1.0 / (self.half_life_per_worker * num_workers)))
        return self._decayed(entry, num_workers) / max(self._decayed(self.total, num_workers), window)


def _name(candidate: object) -> str:
    return getattr(candidate, "worker_name")
