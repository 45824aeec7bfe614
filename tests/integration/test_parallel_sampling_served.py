"""`n` served: the gateway sends a paged worker one request for n outputs, which the engine
computes from one prefill (its blocks forked), and each frame names its output.

Real controller, worker and gateway (uvicorn on loopback), a tiny random Llama, the official
openai client. A backend without parallel sampling (hf) gets one request per choice, as before
(tests/integration/test_e2e.py runs n there).
"""

from __future__ import annotations

import json

import httpx
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from tests.integration.cluster import running_cluster
from tests.polling import wait_until

CHAT = [{"role": "user", "content": "Tell me a long story about the sea and its lighthouses."}]


@pytest.fixture(scope="module")
def paged(tiny_model_dir):
    # No prefix cache: every prompt token the engine computes is counted (a hit would hide a
    # second prefill).
    return build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                       backend="paged", device="cpu", dtype="float32",
                                       kv_cache_memory="64MiB", enable_prefix_caching=False))


@pytest.fixture(scope="module")
def cluster(paged):
    with running_cluster() as cluster:
        cluster.add_worker(paged)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.openai_client()


def computed_prompt_tokens(llm) -> int:
    return llm.engine.stats.num_computed_prompt_tokens


def test_the_worker_announces_n(cluster):
    details = httpx.post(f"{cluster.worker_urls['tiny']}/model_details", json={"model": "tiny"},
                         timeout=10).json()
    assert "n" in details["params"]


def test_n_greedy_outputs_are_one_prefill_and_equal_n_1(client, paged):
    one = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    before = computed_prompt_tokens(paged)
    four = client.chat.completions.create(model="tiny", messages=CHAT, n=4, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    prompt_tokens = four.usage.prompt_tokens
    # One prefill: each output computes only the prompt's last token into its own copy of the
    # last block (engine.llm_engine); four requests would have computed 4 * prompt_tokens.
    assert computed_prompt_tokens(paged) - before == prompt_tokens + 3
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert {c.message.content for c in four.choices} == {one.choices[0].message.content}
    assert four.usage.prompt_tokens == one.usage.prompt_tokens  # counted once, as OpenAI does
    assert four.usage.completion_tokens == 4 * 12


def test_seeded_choices_equal_separate_requests_seeded_seed_plus_i(client):
    kwargs = dict(model="tiny", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    together = client.completions.create(prompt="The sea", n=3, seed=11, **kwargs)
    texts = [c.text for c in sorted(together.choices, key=lambda c: c.index)]
    alone = [client.completions.create(prompt="The sea", seed=11 + i, **kwargs).choices[0].text
             for i in range(3)]
    assert texts == alone
    assert len(set(texts)) > 1


def test_streamed_choices_of_two_prompts_are_numbered_prompt_by_prompt(client, paged):
    before = computed_prompt_tokens(paged)
    chunks = list(client.completions.create(
        model="tiny", prompt=["Once upon a time", "The lighthouse keeper said"], n=2, max_tokens=6,
        temperature=0.8, seed=5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finished = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3]
    usage = chunks[-1].usage
    assert usage.completion_tokens == 4 * 6
    # Two requests of two outputs each: each prompt computed once (plus one token per extra output).
    assert computed_prompt_tokens(paged) - before == usage.prompt_tokens + 2


def test_a_hang_up_frees_every_output(cluster, paged):
    body = {"model": "tiny", "messages": CHAT, "n": 4, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i >= 8:
                break  # hang up mid-stream
    wait_until(lambda: paged.load().num_running == 0 and paged.load().num_waiting == 0,
               what="the engine idle after the client hung up", context=paged.load)
    manager = paged.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_worker_generate_refuses_n_but_its_stream_serves_it(cluster):
    url = cluster.worker_urls["tiny"]
    params = {"model": "tiny", "prompt": "Hello", "max_new_tokens": 3, "n": 2, "temperature": 0.0,
              "stream_deltas": True}
    whole = httpx.post(f"{url}/worker_generate", json=params, timeout=30).json()
    assert whole["error_code"] != 0 and whole["param"] == "n"
    body = httpx.post(f"{url}/worker_generate_stream", json=params, timeout=30).content
    frames = [json.loads(frame) for frame in body.split(b"\0") if frame]
    assert {frame.get("index", 0) for frame in frames} == {0, 1}
    assert sorted(frame.get("index", 0) for frame in frames if frame["finish_reason"]) == [0, 1]
