"""End to end through controller + worker (each backend, real weights) + gateway, with the official
openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.llm.paged import PagedLLM
from llmplatform.llm.build import BackendConfig, build_backend
from tests.integration.cluster import running_cluster
from tests.polling import wait_until

CHAT = [{"role": "user", "content": "Tell me something about the sea."}]


@pytest.fixture(scope="module", params=["hf", "paged"])
def tiny_llm(request, tiny_model_dir):
    if request.param == "hf":
        return HFTransformersLLM(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32",
                                 max_concurrency=4)
    return build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                   backend="paged", device="cpu", dtype="float32",
                                   kv_cache_memory="64MiB"))


@pytest.fixture(scope="module")
def cluster(tiny_llm):
    with running_cluster() as cluster:
        cluster.add_worker(tiny_llm)
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    return cluster.openai_client()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_models_lists_the_worker_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_chat_stream_equals_non_stream_at_temperature_zero(client):
    full = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=24,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"

    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                                 max_tokens=24, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                     max_tokens=20)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                            max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1


def test_usage_matches_the_tokenizer(client, tokenizer):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                           max_tokens=10, extra_body={"ignore_eos": True})
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert reply.usage.completion_tokens == 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 10

    completion = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.prompt_tokens == len(tokenizer("Hello there")["input_ids"])
    assert completion.usage.completion_tokens == 5


def test_n_choices_stream_and_include_usage(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT, n=3, max_tokens=8, temperature=1.0, seed=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    indexes = sorted({c.choices[0].index for c in chunks if c.choices})
    assert indexes == [0, 1, 2]
    for i in range(3):
        finishes = [c for c in chunks if c.choices and c.choices[0].index == i
                    and c.choices[0].finish_reason]
        assert len(finishes) == 1
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_non_stream(client):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, n=3, max_tokens=6, seed=3,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 18


def test_seed_reproducible(client):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_stop_string_is_cut(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                     max_tokens=20, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:9]
    assert stop.strip(), base
    cut = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                    max_tokens=20, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[:base.index(stop)]


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                           logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_completion_echo_logprobs(client):
    reply = client.completions.create(model="tiny", prompt="Hello there", max_tokens=3,
                                      temperature=0, echo=True, logprobs=1,
                                      extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text.startswith("Hello there")
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == reply.usage.prompt_tokens + 3


@pytest.mark.parametrize("body, status", [
    ({"model": "tiny", "messages": []}, 400),
    ({"model": "tiny", "messages": "hello"}, 400),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 0}, 400),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 10**7}, 400),
    ({"model": "tiny", "messages": CHAT, "temperature": -1}, 400),
    ({"model": "tiny", "messages": CHAT, "top_p": 1.5}, 400),
    ({"model": "tiny", "messages": CHAT, "n": 0}, 400),
    ({"model": "tiny", "messages": CHAT, "temperature": "hot"}, 400),
    ({"model": "nope", "messages": CHAT}, 404),
])
def test_bad_chat_input_gets_an_envelope_and_the_server_keeps_serving(cluster, client, body, status):
    response = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    ok = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_malformed_json_is_400(cluster, client):
    response = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", content=b"{not json",
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1).choices


def test_context_overflow_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="word " * 600, max_tokens=10)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10_000,
                                            stream=True))


def test_client_disconnect_aborts_and_frees_resources(cluster, tiny_llm):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.gateway_url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break  # hang up mid-stream
    wait_until(lambda: tiny_llm.load().num_running == 0 and tiny_llm.load().num_waiting == 0,
               what="the engine idle after the client hung up", context=tiny_llm.load)
    if isinstance(tiny_llm, PagedLLM):
        manager = tiny_llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks


def test_worker_reports_engine_load(cluster, tiny_llm):
    status = httpx.post(f"{cluster.worker_urls['tiny']}/worker_get_status", timeout=10).json()
    assert status["queue_length"] == 0 and status["num_running"] == 0
    if isinstance(tiny_llm, PagedLLM):
        assert status["kv_cache_usage"] == 0.0
