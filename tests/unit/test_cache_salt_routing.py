"""cache_aware routing keys its prefix trees (and sessions) by the request's cache salt, as the
engine keys its KV blocks: a prompt salted for one tenant is no routing hint for another, so a
guess is never steered to the worker holding someone else's prefix."""

from __future__ import annotations

from llmplatform.routing.cache_aware import Reason, RouteHint, prefix_hashes
from llmplatform.openai_api.worker_routing import RouteRequest, completion_routing_text, update_from_listing
from llmplatform.routing.router import Router
from tests.unit.controller_fakes import A, B, FakeClock, FixedRandom
from tests.unit.test_gateway_cache_aware_routing import described, listing

SECRET = completion_routing_text("Patient record 4411: diagnosis confidential. " * 12)


def test_salted_chains_share_no_hash_with_other_salts_or_none() -> None:
    plain, a, b = (prefix_hashes(SECRET, cache_salt=s) for s in (None, "key:a", "key:b"))
    assert len(plain) == len(a) == len(b) > 4
    assert set(a).isdisjoint(plain) and set(a).isdisjoint(b) and set(b).isdisjoint(plain)
    assert prefix_hashes(SECRET, cache_salt="key:a") == a  # stable: the same tenant matches itself
    assert RouteHint.of(SECRET).prefix_hashes == plain
    # Sessions live in the salt's namespace too: a guessed `user` id matches nothing.
    sessions = {RouteHint.of(SECRET, "user:alice", s).session for s in (None, "key:a", "key:b")}
    assert len(sessions) == 3


def test_another_tenants_guess_is_routed_by_load_not_to_the_victims_worker() -> None:
    table = Router(max_age=10.0, clock=FakeClock(), rng=FixedRandom(*[0.0] * 20))
    update_from_listing(table, listing(described(A), described(B)), requested_at=0.0)
    victim = table.decide("m", hint=RouteRequest(SECRET, None, "key:victim").hint)
    holder = victim.worker.worker_name
    other = B if holder == A else A
    # The holder is now one request busier: only a match would send the next request there.
    again = table.decide("m", hint=RouteRequest(SECRET, None, "key:victim").hint)
    assert (again.worker.worker_name, again.reason) == (holder, Reason.AFFINITY)
    guess = table.decide("m", hint=RouteRequest(SECRET, None, "key:attacker").hint)
    assert guess.reason is Reason.NO_MATCH and guess.matched_chars == 0
    assert guess.worker.worker_name == other  # least load: the holder has two in flight
    unsalted = table.decide("m", hint=RouteRequest(SECRET).hint)
    assert unsalted.reason is Reason.NO_MATCH  # nor does the same text unsalted
