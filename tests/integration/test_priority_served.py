"""`priority` served (vLLM's extension field): the gateway passes it to a paged worker, whose engine
runs a better-priority request ahead of those queued before it; a worker that does not announce
it (the hf backend) gets no priority, and the client a 400 naming the field.

Real controller, workers and gateway (uvicorn on loopback), a tiny random Llama, the official
openai client.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.llm.hf import HFTransformersLLM
from tests.integration.cluster import running_cluster
from tests.polling import wait_until

CHAT = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def paged(tiny_model_dir):
    # One sequence at a time: every other request waits in the engine's queue, in its order.
    return build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                       backend="paged", device="cpu", dtype="float32",
                                       kv_cache_memory="64MiB", max_num_seqs=1))


@pytest.fixture(scope="module")
def cluster(paged, tiny_model_dir):
    with running_cluster() as cluster:
        cluster.add_worker(paged)
        cluster.add_worker(HFTransformersLLM(str(tiny_model_dir), ("tiny-hf",), device="cpu",
                                             dtype="float32", max_concurrency=2))
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.openai_client()


def test_the_paged_worker_announces_priority_and_the_hf_worker_does_not(cluster):
    def params(model: str) -> list[str]:
        return httpx.post(f"{cluster.worker_urls[model]}/model_details", json={"model": model},
                          timeout=10).json()["params"]

    assert "priority" in params("tiny") and "priority" not in params("tiny-hf")


def test_a_better_priority_request_overtakes_the_queue(client, paged):
    finished: list[tuple[float, str]] = []
    lock = threading.Lock()

    def ask(name: str, priority: int, max_tokens: int) -> None:
        reply = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "priority": priority})
        assert reply.usage.completion_tokens == max_tokens
        with lock:
            finished.append((time.monotonic(), name))

    threads: list[threading.Thread] = []

    def start(name: str, priority: int, max_tokens: int, *, running: int, waiting: int) -> None:
        thread = threading.Thread(target=ask, args=(name, priority, max_tokens))
        thread.start()
        threads.append(thread)
        wait_until(lambda: (paged.load().num_running, paged.load().num_waiting) == (running, waiting),
                   what=f"{name} queued", context=paged.load)

    # A long request (near the tiny model's 512-token context) holds the only slot while three
    # more queue behind it, then a better one.
    start("blocker", 10, 440, running=1, waiting=0)  # long enough to outlast the queueing on a slow machine
    for i in range(3):
        start(f"low-{i}", 10, 24, running=1, waiting=i + 1)
    start("high", 1, 24, running=1, waiting=4)
    for thread in threads:
        thread.join(timeout=120)
    assert [name for _, name in sorted(finished)] == ["blocker", "high", "low-0", "low-1", "low-2"]


def test_priority_on_a_worker_without_it_is_a_400_naming_it(client):
    for call in (lambda **kw: client.chat.completions.create(model="tiny-hf", messages=CHAT, **kw),
                 lambda **kw: client.completions.create(model="tiny-hf", prompt="Once", **kw)):
        with pytest.raises(openai.BadRequestError) as info:
            call(max_tokens=2, extra_body={"priority": -3})
        assert info.value.status_code == 400 and info.value.body["param"] == "priority"
        assert "priority" in info.value.body["message"]
        # 0 is every request's priority: nothing a worker could drop.
        assert call(max_tokens=2, extra_body={"priority": 0}).usage.completion_tokens >= 1


def test_a_malformed_priority_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Once", max_tokens=2,
                                  extra_body={"priority": "urgent"})
    assert info.value.body["param"] == "priority"


def test_completions_take_a_priority_too(client):
    reply = client.completions.create(model="tiny", prompt="Once", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "priority": -2})
    assert reply.usage.completion_tokens == 3
