"""Bad input against a real model: the tiny Llama (real tokenizer, real weights) on the native
engine behind a real controller, worker and gateway, driven with the official openai client.

What a fake worker cannot show: the context check with real token counts, values that reach the
engine's tensors (top_k, stop token ids outside the vocabulary) without hurting it, and a
hypothesis sample that ends in real generations.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

from llmplatform.llm.build import BackendConfig, build_backend
from tests.badinput.test_properties import chat_requests, check_answer, completion_requests
from tests.integration.cluster import Cluster, running_cluster

MODEL = "tiny"
CONTEXT_LENGTH = 512  # the tiny model's max_position_embeddings
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Any) -> Iterator[Cluster]:
    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=(MODEL,), backend="paged",
                                  device="cpu", dtype="float32", kv_cache_memory="64MiB"))
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client()


@pytest.fixture(autouse=True)
def still_serving(cluster: Cluster, client: openai.OpenAI) -> Iterator[None]:
    yield
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    worker = cluster.worker_urls[MODEL]
    assert httpx.get(f"{worker}/health", timeout=10).status_code == 200  # the engine is alive


def test_prompt_plus_max_tokens_beyond_the_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=CONTEXT_LENGTH)
    assert info.value.code == "context_length_exceeded"
    assert str(CONTEXT_LENGTH) in info.value.message


def test_prompt_longer_than_the_context(client: openai.OpenAI) -> None:
    long_prompt = "sea " * (CONTEXT_LENGTH + 50)  # one token per word, and more words than fit
    for call in (
        lambda: client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1),
        lambda: client.completions.create(model=MODEL, prompt=long_prompt),
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}]),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.code == "context_length_exceeded"


def test_caps_with_the_openai_client(client: openai.OpenAI) -> None:
    for kwargs, param in [
        ({"n": 17}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"extra_body": {"chat_template": "{{ 'pwned' }}"}}, "chat_template"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **kwargs)
        assert info.value.param == param, (kwargs, info.value.body)
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, n=16, logprobs=True,
                                           top_logprobs=20, stop=["a" * 256, "b", "c", "d"])
    assert len(reply.choices) == 16
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 20


def test_values_that_reach_the_engine_do_not_hurt_it(client: openai.OpenAI) -> None:
    # The largest top_k the API accepts, with top_p so the top-k path runs, and the last stop
    # token id of the 49152-token vocabulary.
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, top_p=0.5, seed=2**64 - 1,
        extra_body={"top_k": 2**31 - 1, "stop_token_ids": [49151], "ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    # Stop ids outside the vocabulary are refused by the worker, which knows it (with min_tokens
    # they once indexed the sampler's mask and killed the engine); tests/badinput/test_token_ids.py
    # has the whole battery.
    for ids in ([2**31 - 1], [10**6], [49152]):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                           extra_body={"stop_token_ids": ids, "min_tokens": 1})
        assert info.value.param == "stop_token_ids"
    for extra in ({"top_k": 2**31}, {"stop_token_ids": [2**31]}, {"stop_token_ids": [-1]}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body=extra)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, seed=2**64)
    assert info.value.param == "seed"


@pytest.mark.parametrize("prompt", [[1, 2, 3], [49152, 10**9], [[5, 6]]])
def test_token_id_prompts_are_refused(client: openai.OpenAI, prompt: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert info.value.param == "prompt"


def test_min_tokens_above_max_tokens_is_the_workers_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"min_tokens": 5})
    assert "min_tokens" in info.value.message


def _bounded(body: Any) -> Any:
    """Keep generations short: a small explicit max_tokens (chat defaults to the whole context)."""
    if isinstance(body, dict):
        body = dict(body)
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 3 < value <= CONTEXT_LENGTH:
                body[key] = 3
        body.setdefault("max_tokens", 3)
        body["model"] = MODEL if body.get("model") == "fake-model" else body.get("model")
    return body


REAL_SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@REAL_SETTINGS
@given(body=chat_requests.map(_bounded))
def test_property_chat_against_the_real_model(cluster: Cluster, body: Any) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    check_answer(httpx.post(f"{cluster.gateway_url}/v1/chat/completions", content=raw,
                            headers={"Content-Type": "application/json"}, timeout=60))


@REAL_SETTINGS
@given(body=completion_requests.map(_bounded))
def test_property_completions_against_the_real_model(cluster: Cluster, body: Any) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    check_answer(httpx.post(f"{cluster.gateway_url}/v1/completions", content=raw,
                            headers={"Content-Type": "application/json"}, timeout=60))
