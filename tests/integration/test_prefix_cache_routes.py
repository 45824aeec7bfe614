"""Prefix caching through real servers: the worker's status counters and `/reset_prefix_cache`,
and the gateway's `POST /v1/admin/reset_prefix_cache` with its admin-key rules."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import running_cluster
from tests.stub_workers import stub_workers

PROMPT = "The sea, the river and the mountain are old friends. " * 6
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                  backend="paged", device="cpu", dtype="float32",
                                  kv_cache_memory="64MiB", block_size=BLOCK_SIZE))
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        yield cluster


@pytest.fixture(scope="module")
def keyed_gateway(cluster):
    """A second gateway on the same controller, with user and admin keys."""
    settings = GatewaySettings(controller_address=cluster.controller_url, api_keys=("user-key",),
                               admin_api_keys=("admin-key",))
    with serve_in_thread(create_gateway_app(settings)) as url:
        yield url


def status(worker_url: str) -> dict:
    return httpx.post(f"{worker_url}/worker_get_status", timeout=10).json()


def complete(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)


def reset(gateway_url: str, key: str | None = None, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gateway_url}/v1/admin/reset_prefix_cache",
                      json={"model": "tiny"} if body is None else body, headers=headers, timeout=30)


def test_status_counts_hits_and_a_reset_through_the_gateway_makes_the_next_request_miss(cluster):
    worker = cluster.worker_urls["tiny"]
    before = status(worker)
    assert isinstance(before["prefix_cache_queries"], int) and isinstance(before["prefix_cache_hits"], int)
    complete(cluster.gateway_url)
    first = status(worker)
    num_prompt_tokens = first["prefix_cache_queries"] - before["prefix_cache_queries"]
    assert num_prompt_tokens > 2 * BLOCK_SIZE
    complete(cluster.gateway_url)
    second = status(worker)
    assert second["prefix_cache_queries"] - first["prefix_cache_queries"] == num_prompt_tokens
    # All of the prompt's full blocks but the one holding its last token came from the cache.
    assert second["prefix_cache_hits"] - first["prefix_cache_hits"] == \
        (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE

    response = reset(cluster.gateway_url)  # no keys configured: open
    assert response.status_code == 200
    assert response.json() == {"model": "tiny", "success": True,
                               "workers": [{"address": worker, "success": True}]}
    complete(cluster.gateway_url)
    third = status(worker)
    assert third["prefix_cache_queries"] - second["prefix_cache_queries"] == num_prompt_tokens
    assert third["prefix_cache_hits"] == second["prefix_cache_hits"]  # a miss

    # The worker's own route does the same.
    assert httpx.post(f"{worker}/reset_prefix_cache", timeout=10).json() == \
        {"success": True, "model_names": ["tiny"]}
    complete(cluster.gateway_url)
    assert status(worker)["prefix_cache_hits"] == third["prefix_cache_hits"]


def test_admin_route_needs_an_admin_key_when_keys_are_configured(keyed_gateway):
    assert reset(keyed_gateway).status_code == 401
    assert reset(keyed_gateway, "wrong").status_code == 401
    denied = reset(keyed_gateway, "user-key")
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "insufficient_permissions"
    assert reset(keyed_gateway, "admin-key").json()["success"] is True
    # Both kinds of key may use the ordinary /v1 routes.
    for key in ("user-key", "admin-key"):
        models = httpx.get(f"{keyed_gateway}/v1/models", headers={"Authorization": f"Bearer {key}"},
                           timeout=10)
        assert models.status_code == 200


def test_admin_route_errors(cluster):
    missing = reset(cluster.gateway_url, body={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    bad = reset(cluster.gateway_url, body={})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


def test_a_backend_without_prefix_cache_says_so(tiny_model_dir):
    llm = HFTransformersLLM(str(tiny_model_dir), ("tiny-hf",), device="cpu", dtype="float32")
    with serve_in_thread(create_worker_app(llm, WorkerSettings(register=False))) as url:
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).json() == \
            {"success": False, "model_names": ["tiny-hf"]}
        worker_status = status(url)
        assert worker_status["prefix_cache_queries"] is None
        assert worker_status["prefix_cache_hits"] is None


def test_the_admin_reset_reaches_every_worker_of_the_model(tiny_model_dir):
    def paged() -> object:
        return build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                       backend="paged", device="cpu", dtype="float32",
                                       kv_cache_memory="64MiB", block_size=BLOCK_SIZE))

    with running_cluster() as two:
        urls = [two.add_worker(paged()), two.add_worker(paged())]
        for url in urls:  # fill each worker's cache with the prompt
            httpx.post(f"{url}/worker_generate", json={"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2,
                                                       "temperature": 0}, timeout=60).raise_for_status()
        filled = {url: status(url)["prefix_cache_hits"] for url in urls}
        response = reset(two.gateway_url)
        assert response.status_code == 200
        assert response.json() == {"model": "tiny", "success": True,
                                   "workers": [{"address": url, "success": True} for url in sorted(urls)]}
        for url in urls:  # the same prompt again misses on both
            before = status(url)
            httpx.post(f"{url}/worker_generate", json={"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2,
                                                       "temperature": 0}, timeout=60).raise_for_status()
            after = status(url)
            assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
            assert after["prefix_cache_hits"] == before["prefix_cache_hits"] == filled[url]


def test_an_unreachable_worker_does_not_stop_the_others_being_reset(cluster):
    # A worker the controller confirmed (its status answered), then gone: refused at once.
    with stub_workers() as stubs:
        gone = stubs.url("gone", ["tiny"])
        body = {"worker_name": gone, "check_heart_beat": False,
                "worker_status": {"model_names": ["tiny"], "speed": 1, "queue_length": 0}}
        assert httpx.post(f"{cluster.controller_url}/register_worker", json=body, timeout=10).status_code == 200
    try:
        response = reset(cluster.gateway_url)
        assert response.status_code == 200
        answer = response.json()
        assert answer["success"] is False
        by_address = {w["address"]: w for w in answer["workers"]}
        assert by_address[cluster.worker_urls["tiny"]] == {"address": cluster.worker_urls["tiny"], "success": True}
        assert by_address[gone]["success"] is False and "unreachable" in by_address[gone]["error"]
    finally:
        httpx.post(f"{cluster.controller_url}/deregister_worker", json={"worker_name": gone}, timeout=10)
