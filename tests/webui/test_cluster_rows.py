"""The Cluster tab's row for one worker: the prefix-cache hit rate the worker reports."""

from __future__ import annotations

from llmplatform.protocol.controller import WorkerDescription
from llmplatform.webui.cluster import COLUMNS, worker_row


def described(**facts: object) -> WorkerDescription:
    return WorkerDescription(worker_name="http://w:1", model_names=["m"], speed=1, queue_length=0,
                             last_heartbeat_age_s=2.0, **facts)


def test_the_row_shows_the_prefix_cache_hit_rate() -> None:
    row = dict(zip(COLUMNS, worker_row(described(prefix_cache_queries=4000, prefix_cache_hits=3000))))
    assert row["prefix-cache hits"] == "75.0% of 4,000 tokens"
    assert row["last heartbeat"] == "2.0 s ago"


def test_no_prefix_cache_or_no_prompt_yet_is_a_dash() -> None:
    for facts in ({}, {"prefix_cache_queries": 0, "prefix_cache_hits": 0}):
        assert dict(zip(COLUMNS, worker_row(described(**facts))))["prefix-cache hits"] == "-"


def test_a_worker_left_down_shows_why_and_when_it_is_retried() -> None:
    from llmplatform.protocol.controller import DownWorker
    from llmplatform.webui.cluster import down_row

    down = DownWorker(worker_name="http://w:2", service="worker 1", model_names=["m"],
                      reason="exited unexpectedly (killed by SIGKILL) 3 times within 60 s",
                      down_for_s=12.4, retry_in_s=47.6)
    row = dict(zip(COLUMNS, down_row(down)))
    assert len(down_row(down)) == len(COLUMNS)
    assert row["worker"] == "http://w:2 (worker 1)" and row["models"] == "m"
    assert row["state"] == ("DOWN for 12 s: exited unexpectedly (killed by SIGKILL) 3 times "
                            "within 60 s; retry in 48 s")
    assert dict(zip(COLUMNS, worker_row(described())))["state"] == "up"
