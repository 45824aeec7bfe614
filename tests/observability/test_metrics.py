"""GET /metrics on a real cluster (controller, a worker with real tiny weights on each backend,
gateway), scraped with Prometheus' own text parser while real requests run through the official
openai client: the numbers move by exactly what the requests did."""

from __future__ import annotations

import time

import openai
import pytest

from llmplatform.llm.hf import HFTransformersLLM
from tests.integration.cluster import paged_tiny_llm, running_cluster
from tests.observability.scrape import delta, scrape, value
from tests.polling import wait_until

CHAT = [{"role": "user", "content": "Count to ten."}]
M = {"model_name": "tiny"}


@pytest.fixture(scope="module", params=["paged", "hf"])
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(backend, tiny_model_dir):
    if backend == "hf":
        llm = HFTransformersLLM(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32",
                                max_concurrency=2)
    else:
        llm = paged_tiny_llm(tiny_model_dir)
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def worker_url(cluster):
    return cluster.worker_urls["tiny"]


def _finished(worker_url: str, before, reason: str) -> bool:
    return delta(before, scrape(worker_url), "llmplatform:request_success_total",
                 finished_reason=reason, **M) >= 1


def test_a_completion_moves_every_worker_and_gateway_series(cluster, client, worker_url):
    worker_before, gateway_before = scrape(worker_url), scrape(cluster.gateway_url)
    started = time.monotonic()
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    usage = completion.usage
    assert usage.completion_tokens == 8
    # The request's last accounting runs as its stream closes, just after the client has it.
    wait_until(lambda: _finished(worker_url, worker_before, "length"), what="the request to be counted")
    elapsed = time.monotonic() - started  # the worker's accounting ends inside this span
    after = scrape(worker_url)

    assert delta(worker_before, after, "llmplatform:prompt_tokens_total", **M) == usage.prompt_tokens
    assert delta(worker_before, after, "llmplatform:generation_tokens_total", **M) == 8
    sums = {}
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"):
        assert delta(worker_before, after, f"llmplatform:{histogram}_count", **M) == 1, histogram
        sums[histogram] = delta(worker_before, after, f"llmplatform:{histogram}_sum", **M)
    # One request's times, each measured inside the test's own wait for it: ordered, and
    # neither zero (a clock never read) nor beyond what the client waited.
    assert 0 < sums["request_queue_time_seconds"] <= sums["time_to_first_token_seconds"], sums
    assert sums["time_to_first_token_seconds"] < sums["e2e_request_latency_seconds"] <= elapsed, sums
    # One gap per token after the first.
    assert delta(worker_before, after, "llmplatform:inter_token_latency_seconds_count", **M) == 7
    assert delta(worker_before, after, "llmplatform:request_success_total",
                 finished_reason="length", **M) == 1
    assert delta(worker_before, after, "llmplatform:request_success_total",
                 finished_reason="stop", **M) == 0

    # The gateway counts an exchange once its last byte is sent.
    route = {"route": "/v1/completions", "model": "tiny"}
    wait_until(lambda: delta(gateway_before, scrape(cluster.gateway_url),
                             "llmplatform:gateway_requests_total", status="200", **route) >= 1,
               what="the gateway to count the request")
    gateway_after = scrape(cluster.gateway_url)
    assert delta(gateway_before, gateway_after, "llmplatform:gateway_requests_total",
                 status="200", **route) == 1
    assert delta(gateway_before, gateway_after,
                 "llmplatform:gateway_request_duration_seconds_count", **route) == 1


def test_running_gauge_while_a_stream_is_open_and_abort_when_it_closes(backend, client,
                                                                        worker_url):
    before = scrape(worker_url)
    assert value(before, "llmplatform:num_requests_running", **M) == 0
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=450,
                                            stream=True, extra_body={"ignore_eos": True})
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # generating now, with ~450 tokens to go
        during = scrape(worker_url)
        assert value(during, "llmplatform:num_requests_running", **M) == 1
        assert value(during, "llmplatform:num_requests_waiting", **M) == 0
        if backend == "paged":
            assert value(during, "llmplatform:kv_cache_usage_perc", **M) > 0
        assert delta(before, during, "llmplatform:time_to_first_token_seconds_count", **M) == 1
        assert delta(before, during, "llmplatform:generation_tokens_total", **M) >= 1
    finally:
        stream.close()
    # Closing the stream aborts the request down to the backend; it is counted as an abort.
    wait_until(lambda: _finished(worker_url, before, "abort"), what="the aborted request to be counted")
    wait_until(lambda: value(scrape(worker_url), "llmplatform:num_requests_running", **M) == 0,
               what="the running gauge to drop")


def test_backend_specific_series(backend, client, worker_url):
    before = scrape(worker_url)
    client.completions.create(model="tiny", prompt="The same prompt, twice over", max_tokens=2,
                              temperature=0)
    wait_until(lambda: sum(delta(before, scrape(worker_url), "llmplatform:request_success_total",
                                 finished_reason=r, **M) for r in ("stop", "length")) >= 1,
               what="the request to be counted")
    after = scrape(worker_url)
    names = ("llmplatform:kv_cache_usage_perc", "llmplatform:prefix_cache_queries_total",
             "llmplatform:prefix_cache_hits_total", "llmplatform:num_preemptions_total",
             "llmplatform:prefix_cache_deferred_requests_total")
    if backend == "hf":
        # No paged KV cache: absent, never a misleading 0.
        assert all(value(after, name, **M) is None for name in names)
    else:
        assert all(value(after, name, **M) is not None for name in names)
        assert delta(before, after, "llmplatform:prefix_cache_queries_total", **M) > 0
        assert value(after, "llmplatform:kv_cache_usage_perc", **M) == 0  # nothing running


def test_gateway_counts_errors_by_status_without_unknown_model_labels(cluster, client):
    before = scrape(cluster.gateway_url)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-3)
    route = "/v1/completions"

    def counted(samples) -> bool:
        return all(delta(before, samples, "llmplatform:gateway_requests_total", route=route,
                         model="", status=status) >= 1 for status in ("400", "404"))

    wait_until(lambda: counted(scrape(cluster.gateway_url)), what="both errors to be counted")
    after = scrape(cluster.gateway_url)
    assert delta(before, after, "llmplatform:gateway_requests_total", route=route, model="",
                 status="404") == 1
    assert delta(before, after, "llmplatform:gateway_requests_total", route=route, model="",
                 status="400") == 1
    assert not any(dict(labels).get("model") == "no-such-model" for _, labels in after)


def test_controller_counts_live_workers_and_registrations(cluster):
    samples = scrape(cluster.controller_url)
    assert value(samples, "llmplatform:controller_workers", model_name="tiny") == 1
    assert value(samples, "llmplatform:controller_registrations_total") >= 1
    assert value(samples, "llmplatform:controller_worker_expiries_total") == 0


def test_preemptions_are_counted(tiny_model_dir):
    """Two generations that cannot both fit a 9-block KV cache: one is preempted."""
    import httpx

    from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from llmplatform.llm.paged import PagedLLM
    from llmplatform.model_worker.app import WorkerSettings, create_app
    from llmplatform.utils.server import serve_in_thread

    llm = PagedLLM(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=9),  # 144 tokens
        scheduler=SchedulerConfig(max_model_len=128)))
    app = create_app(llm, WorkerSettings(register=False, limit_worker_concurrency=8))
    params = {"model": "tiny", "prompt": "Hi", "max_new_tokens": 120, "ignore_eos": True,
              "echo": False}
    with serve_in_thread(app) as url:
        before = scrape(url)
        assert value(before, "llmplatform:num_preemptions_total", **M) == 0
        with httpx.stream("POST", f"{url}/worker_generate_stream", json=params,
                          timeout=120) as first:
            chunks = first.iter_bytes()
            next(chunks)  # the first is decoding: the second will outgrow what is left
            second = httpx.post(f"{url}/worker_generate", json=params, timeout=120).json()
            rest = b"".join(chunks)
        assert second["finish_reason"] == "length" and b'"finish_reason":"length"' in rest
        wait_until(lambda: delta(before, scrape(url), "llmplatform:request_success_total",
                                 finished_reason="length", **M) == 2, what="both requests to be counted")
        after = scrape(url)
        assert delta(before, after, "llmplatform:num_preemptions_total", **M) >= 1
        assert delta(before, after, "llmplatform:generation_tokens_total", **M) == 240
