"""The gateway end to end over fake workers: happy paths and auth (tests/integration/fake_worker.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.integration.fake_worker import (  # noqa: F401  (cluster, client, http: fixtures)
    API_KEY,
    CONTEXT_LENGTH,
    DEAD_MODEL,
    FULL_REPLY,
    GONE_MODEL,
    MODEL,
    REPLY,
    STOCK_MODEL,
    USER,
    Cluster,
    client,
    cluster,
    count_tokens,
    http,
)

# ---- happy paths -----------------------------------------------------------------------------------


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {MODEL, STOCK_MODEL, GONE_MODEL, DEAD_MODEL} <= ids
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "llmplatform")
    response = http.get("/v1/models/no-such-model")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert http.get("/health").status_code == 200


def test_chat_non_streamed(client: openai.OpenAI, cluster: Cluster) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == FULL_REPLY
    assert result.choices[0].finish_reason == "stop"
    prompt_tokens = count_tokens("<user> Say hi\n<assistant>")
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == len(REPLY)
    assert result.usage.total_tokens == prompt_tokens + len(REPLY)
    sent = cluster.worker.params[-1]
    assert sent["echo"] is False and sent["max_new_tokens"] == 20 and sent["prompt"] == "<user> Say hi\n<assistant>"


def test_chat_default_max_tokens_fills_context(client: openai.OpenAI, cluster: Cluster) -> None:
    client.chat.completions.create(model=MODEL, messages=USER)
    assert cluster.worker.params[-1]["max_new_tokens"] == CONTEXT_LENGTH - count_tokens("<user> Say hi\n<assistant>")


def test_chat_length_and_stop(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=2, max_tokens=30)
    assert result.choices[0].message.content == "Hello,"
    assert result.choices[0].finish_reason == "length"
    result = client.chat.completions.create(model=MODEL, messages=USER, stop=[" from"])
    assert result.choices[0].message.content == "Hello, café"
    assert result.choices[0].finish_reason == "stop"


def test_chat_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == FULL_REPLY  # the half character was held back, never sent
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_chat_stream_raw_sse(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": USER, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: ") :])
    assert "usage" not in first  # only with stream_options.include_usage
    final = json.loads(events[-2][len("data: ") :])
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "stop"


def test_chat_n3_streamed_with_usage(client: openai.OpenAI, cluster: Cluster) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, n=3, seed=11, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    usage = usage_chunks[0].usage
    prompt_tokens = count_tokens("<user> Say hi\n<assistant>")
    assert usage.prompt_tokens == prompt_tokens  # the prompt counts once, not once per choice
    assert usage.completion_tokens == 3 * len(REPLY)
    assert all(c.usage is None for c in chunks[:-1])
    by_index: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        by_index[c.choices[0].index].append(c.choices[0])
    for index, choices in by_index.items():
        assert choices[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in choices) == FULL_REPLY
        assert [ch.finish_reason for ch in choices if ch.finish_reason] == ["stop"], index
    seeds = sorted(p["seed"] for p in cluster.worker.params[-3:])
    assert seeds == [11, 12, 13]
    assert len({p["request_id"] for p in cluster.worker.params[-3:]}) == 3


def test_chat_n3_non_streamed(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, n=3, max_tokens=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello, caf" and c.finish_reason == "length" for c in result.choices)
    assert result.usage.completion_tokens == 9


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2, max_tokens=2)
    content = result.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hello", ","]
    assert content[0].logprob == -0.5 and content[0].bytes == list(b"Hello")
    assert [t.token for t in content[0].top_logprobs] == ["Hello", "other1"]
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=1, stream=True
    )
    tokens = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == REPLY


def test_completions(client: openai.OpenAI, cluster: Cluster) -> None:
    result = client.completions.create(model=MODEL, prompt="Once upon")
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.choices[0].text == FULL_REPLY and result.choices[0].finish_reason == "stop"
    assert cluster.worker.params[-1]["max_new_tokens"] == 16  # OpenAI's default
    assert cluster.worker.params[-1]["echo"] is False
    assert result.usage.prompt_tokens == 2

    echoed = client.completions.create(model=MODEL, prompt="Once upon", echo=True, max_tokens=2, logprobs=1)
    assert echoed.choices[0].text == "Once uponHello,"
    assert echoed.choices[0].logprobs.tokens == ["Hello", ","]
    assert echoed.choices[0].logprobs.text_offset == [9, 14]
    sent = cluster.worker.params[-1]
    assert sent["echo"] is True and sent["logprobs"] == 1 and sent["prompt_logprobs"] == 1


def test_completions_several_prompts(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=["a b", "c d e"], n=2, max_tokens=1)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert all(c.text == "Hello" for c in result.choices)
    assert result.usage.prompt_tokens == 2 + 3
    assert result.usage.completion_tokens == 4


def test_completions_streamed(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="Once", n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(REPLY)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert "".join(c.text for c in mine) == FULL_REPLY
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]


def test_stock_worker_fallback(client: openai.OpenAI, cluster: Cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(model=STOCK_MODEL, messages=messages, stop="never")
    assert result.choices[0].message.content == FULL_REPLY
    sent = cluster.stock_worker.params[-1]
    assert sent["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sent["stop"] == ["never", "<|im_end|>"]
    assert sent["stop_token_ids"] == [7]
    assert sent["max_new_tokens"] == CONTEXT_LENGTH - count_tokens(sent["prompt"])


# ---- auth ------------------------------------------------------------------------------------------


def test_api_key_required(cluster: Cluster) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + API_KEY}):
        response = httpx.get(f"{cluster.gateway}/v1/models", headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    wrong = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=USER)
    other = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="sk-other", max_retries=0)
    assert other.models.list().data


@pytest.mark.parametrize("stream", [True, False])
def test_requests_reuse_pooled_connections_to_the_worker(client: openai.OpenAI, cluster: Cluster, stream: bool) -> None:
    """One request after another: the gateway reads each worker stream to its end, so the
    connection goes back to the pool and the next request reuses one (a stream dropped right
    after its final chunk would be closed half-read and cost a new TCP connection every request,
    from a port the worker has not seen yet)."""
    def ask() -> None:
        response = client.chat.completions.create(model=MODEL, messages=USER, stream=stream)
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in response if c.choices) == FULL_REPLY
        else:
            assert response.choices[0].message.content == FULL_REPLY

    ask()  # at least one pooled connection, whichever tests ran before
    with cluster.worker.lock:
        first = len(cluster.worker.client_ports)
        pooled = set(cluster.worker.client_ports)
    for _ in range(4):
        ask()
    with cluster.worker.lock:
        ports = cluster.worker.client_ports[first:]
    assert len(ports) == 4 and set(ports) <= pooled, (ports, pooled)
