"""The gateway's routing table under the controller's cache_aware method: the same policy as the
controller's (routing/cache_aware.py), with the controller's knobs, over the request's hint;
and the routing text a request is matched by."""

from __future__ import annotations

from llmplatform.routing.cache_aware import CacheAwareConfig, Reason
from llmplatform.openai_api.worker_routing import (
    RouteRequest,
    chat_routing_text,
    completion_routing_text,
    session_key,
    update_from_listing,
)
from llmplatform.protocol.controller import CacheAwareOptions, ListWorkersResponse, WorkerDescription
from llmplatform.routing.router import Router
from tests.unit.controller_fakes import A, B, FakeClock, FixedRandom

SYSTEM = {"role": "system", "content": "You are a terse assistant for a shipping company. " * 20}


def described(name: str, *, running: int = 0, epoch: str | None = "e0", caching: bool = True
              ) -> WorkerDescription:
    return WorkerDescription(worker_name=name, model_names=["m"], speed=1, queue_length=running,
                             num_running=running, num_waiting=0, kv_cache_usage=0.0,
                             last_heartbeat_age_s=0.0, max_num_running=8, cache_epoch=epoch,
                             prefix_cache_queries=0 if caching else None)


def listing(*workers: WorkerDescription, threshold: int = 2, **knobs: object) -> ListWorkersResponse:
    options = CacheAwareOptions(balance_threshold=threshold, entry_ttl_s=600.0,
                                max_chunks_per_worker=1024, max_sessions=16, **knobs)
    return ListWorkersResponse(workers=list(workers), dispatch_method="cache_aware", cache_aware=options)


def chat(*turns: str, user: str | None = None) -> RouteRequest:
    messages = [SYSTEM] + [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                           for i, t in enumerate(turns)]
    return RouteRequest(chat_routing_text(messages), session_key({}, None, user))


def test_routing_text_extends_as_the_conversation_does() -> None:
    one = chat_routing_text([SYSTEM, {"role": "user", "content": "hi"}])
    two = chat_routing_text([SYSTEM, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}])
    assert two.startswith(one)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat_routing_text([SYSTEM], tools) != chat_routing_text([SYSTEM])
    assert completion_routing_text([1, 2, 3]) == "1,2,3,"
    assert completion_routing_text([1, 2, 3, 4]).startswith(completion_routing_text([1, 2, 3]))


def test_session_key_prefers_the_named_header() -> None:
    assert session_key({"x-session": "s1"}, "x-session", "alice") == "header:s1"
    assert session_key({}, "x-session", "alice") == "user:alice"
    assert session_key({"x-session": "s1"}, None, None) is None


def test_table_keeps_a_conversation_on_its_worker_until_the_threshold() -> None:
    clock = FakeClock()
    table = Router(max_age=10.0, clock=clock, rng=FixedRandom(*[0.0] * 20))
    # A conversation is a cold prefix (its own): the cold threshold is the one that applies.
    update_from_listing(table, listing(described(A), described(B), cold_balance_threshold=2),
                        requested_at=0.0)
    first = table.decide("m", hint=chat("Where is my parcel?").hint)
    assert (first.worker.worker_name, first.reason) == (A, Reason.NO_MATCH)
    # The table counts its own pick: A is 1 ahead, within the threshold of 2.
    second = table.decide("m", hint=chat("Where is my parcel?", "In Lyon.", "When will it arrive?").hint)
    assert (second.worker.worker_name, second.reason) == (A, Reason.AFFINITY)
    assert second.matched_chars > len(SYSTEM["content"])
    third = table.decide("m", hint=chat("Where is my parcel?", "In Lyon.", "Thanks").hint)
    assert (third.worker.worker_name, third.reason) == (A, Reason.AFFINITY)  # 2 ahead: within
    # A fourth would put A 3 ahead of B: load decides.
    fourth = table.decide("m", hint=chat("Where is my parcel?", "In Lyon.", "Bye").hint)
    assert (fourth.worker.worker_name, fourth.reason) == (B, Reason.LOAD_OVERRIDE)
    # No route offered (a failover pick): plain least_load.
    assert table.decide("m").reason is Reason.NO_MATCH


def test_table_forgets_a_worker_whose_cache_epoch_moved() -> None:
    table = Router(max_age=10.0, clock=FakeClock(), rng=FixedRandom(*[0.0] * 20))
    update_from_listing(table, listing(described(A), described(B, running=1)), requested_at=0.0)
    assert table.decide("m", hint=chat("q1").hint).worker.worker_name == A
    update_from_listing(table, listing(described(A, epoch="e1"), described(B, running=1)), requested_at=1.0)
    decision = table.decide("m", hint=chat("q1").hint)
    assert (decision.worker.worker_name, decision.reason) == (A, Reason.NO_MATCH)  # load only


def test_table_keeps_what_it_learned_across_reads_and_takes_new_knobs() -> None:
    table = Router(max_age=10.0, clock=FakeClock(), rng=FixedRandom(*[0.0] * 20))
    update_from_listing(table, listing(described(A), described(B)), requested_at=0.0)
    assert table.decide("m", hint=chat("q1").hint).worker.worker_name == A
    update_from_listing(table, listing(described(A, running=5), described(B), threshold=10), requested_at=1.0)
    kept = table.decide("m", hint=chat("q1", "a", "q2").hint)
    assert (kept.worker.worker_name, kept.reason) == (A, Reason.AFFINITY)  # 5 - 0 <= 10


def test_table_takes_the_controllers_hot_and_cold_knobs() -> None:
    """An older controller sends neither: the gateway's defaults. A newer one's reach the table."""
    table = Router(max_age=10.0, clock=FakeClock(), rng=FixedRandom(*[0.0] * 20))
    update_from_listing(table, listing(described(A), described(B)), requested_at=0.0)
    policy = table.policy
    assert policy is not None and policy.cache_aware is not None
    assert policy.cache_aware.config.cold_balance_threshold == CacheAwareConfig().cold_balance_threshold
    update_from_listing(table, listing(described(A), described(B), cold_balance_threshold=3,
                                       heat_half_life=9.0), requested_at=1.0)
    config = table.policy.cache_aware.config
    assert (config.cold_balance_threshold, config.heat_half_life) == (3, 9.0)
