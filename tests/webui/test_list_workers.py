"""The controller's read-only `GET /list_workers` (what the web UI's Cluster tab shows, and what
gateways routing locally read)."""

from __future__ import annotations

import httpx

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.utils.server import serve_in_thread
from tests.stub_workers import stub_workers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_list_workers_shows_each_live_workers_facts():
    clock = Clock()
    app = create_controller_app(ControllerConfig(heartbeat_expiration=30.0), clock=clock)
    with serve_in_thread(app) as url, stub_workers() as stubs:
        # The default method, and its knobs (a gateway routing locally runs the same policy).
        assert httpx.get(f"{url}/list_workers", timeout=5).json() == {
            "workers": [], "dispatch_method": "cache_aware", "cache_aware": {
                "balance_threshold": 2, "cold_balance_threshold": 8, "heat_half_life": 4.0,
                "entry_ttl_s": 600.0, "max_chunks_per_worker": 32768, "max_sessions": 65536},
            "down_workers": []}
        ours = {"model_names": ["a", "b"], "speed": 2, "queue_length": 3, "num_running": 2,
                "num_waiting": 1, "kv_cache_usage": 0.25, "backend": "paged",
                "max_num_running": 8, "tasks": ["generate"]}
        stock = {"model_names": ["c"], "speed": 1, "queue_length": 0}  # a FastChat worker
        # The controller confirms each with the worker's own status (stub routes answer it).
        first, second = stubs.url("1", **ours), stubs.url("2", **stock)
        for name, status in ((first, ours), (second, stock)):
            response = httpx.post(f"{url}/register_worker", timeout=5, json={
                "worker_name": name, "check_heart_beat": True, "worker_status": status})
            assert response.status_code == 200
        clock.now += 4.5
        # A heartbeat updates the load facts and the age; the backend stays as registered.
        beat = httpx.post(f"{url}/receive_heart_beat", timeout=5, json={
            "worker_name": second, "queue_length": 5})
        assert beat.json() == {"exist": True}
        clock.now += 1.0
        # A dispatch since the heartbeat shows (what a gateway routing locally adds to the load).
        # Neither worker reports a prefix cache: cache_aware ranks them by load alone.
        picked = httpx.post(f"{url}/get_worker_address", json={"model": "a"}, timeout=5)
        assert picked.json() == {"address": first, "reason": "no_cache"}
        workers = httpx.get(f"{url}/list_workers", timeout=5).json()["workers"]
        assert workers == [
            {"worker_name": first, "model_names": ["a", "b"], "backend": "paged",
             "tasks": ["generate"], "lora_adapters": None, "speed": 2, "queue_length": 3,
             "num_running": 2, "num_waiting": 1,
             "kv_cache_usage": 0.25, "last_heartbeat_age_s": 5.5, "max_num_running": 8,
             "num_dispatched": 1, "prefix_cache_queries": None, "prefix_cache_hits": None,
             "cache_epoch": None},
            {"worker_name": second, "model_names": ["c"], "backend": None,
             "tasks": None, "lora_adapters": None, "speed": 1, "queue_length": 5, "num_running": None,
             "num_waiting": None,
             "kv_cache_usage": None, "last_heartbeat_age_s": 1.0, "max_num_running": None,
             "num_dispatched": 0, "prefix_cache_queries": None, "prefix_cache_hits": None,
             "cache_epoch": None},
        ]
        # Only live workers are listed: the first is now stale (30.5 s > 30 s), the second not.
        clock.now += 25.0
        listed = httpx.get(f"{url}/list_workers", timeout=5).json()["workers"]
        names = [w["worker_name"] for w in listed]
        assert names == [second]
