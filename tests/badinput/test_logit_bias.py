"""logit_bias end to end, as OpenAI defines it: the official openai client, through the gateway,
to the tiny model on both backends (one shared sampler), and the gateway's refusal to send it to
a worker that did not announce it (a stock worker would drop it and generate unconstrained).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.badinput.conftest import BACKENDS, TwoBackendCluster, model_name
from tests.fake_worker import MODEL as FAKE_MODEL
from tests.fake_worker import FakeCluster, fake_cluster
from tests.fake_worker import reply as fake_reply

PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def client(two_backends: TwoBackendCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{two_backends.gateway_url}/v1", api_key="none", max_retries=0, timeout=60)


def token_id(two_backends: TwoBackendCluster, text: str) -> int:
    ids = two_backends.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def greedy_first_token(client: openai.OpenAI, backend: str, bias: dict[str, float] | None = None) -> str:
    reply = client.completions.create(model=model_name(backend), prompt=PROMPT, max_tokens=1, temperature=0,
                                      logit_bias=bias)
    return reply.choices[0].text


@pytest.mark.parametrize("backend", BACKENDS)
def test_plus_100_forces_a_token(client: openai.OpenAI, two_backends: TwoBackendCluster, backend: str) -> None:
    ocean = token_id(two_backends, " ocean")
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.create(
            model=model_name(backend), messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            temperature=temperature, seed=1, logit_bias={str(ocean): 100}, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == " ocean ocean ocean", (temperature, reply)
    reply = client.completions.create(model=model_name(backend), prompt=PROMPT, max_tokens=2, temperature=0.8,
                                      logit_bias={str(ocean): 100.0})
    assert reply.choices[0].text == " ocean ocean"


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_100_bans_the_greedy_choice(client: openai.OpenAI, two_backends: TwoBackendCluster,
                                          backend: str) -> None:
    first = greedy_first_token(client, backend)
    banned = token_id(two_backends, first)
    assert two_backends.tokenizer.decode([banned]) == first
    assert greedy_first_token(client, backend) == first  # greedy is deterministic
    assert greedy_first_token(client, backend, {str(banned): -100}) != first
    assert greedy_first_token(client, backend, {str(banned): -0.0}) == first


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_stays_with_its_request(client: openai.OpenAI, two_backends: TwoBackendCluster, backend: str) -> None:
    """Concurrent requests (batched together on the paged engine): only the biased ones change."""
    baseline = client.completions.create(model=model_name(backend), prompt=PROMPT, max_tokens=4,
                                         temperature=0).choices[0].text
    whale = token_id(two_backends, " whale")

    def complete(bias: dict[str, float] | None) -> str:
        return client.completions.create(model=model_name(backend), prompt=PROMPT, max_tokens=4, temperature=0,
                                         logit_bias=bias).choices[0].text

    biases = [None, {str(whale): 100}, None, {str(whale): 100}, None, None]
    with concurrent.futures.ThreadPoolExecutor(len(biases)) as pool:
        texts = list(pool.map(complete, biases))
    for bias, text in zip(biases, texts):
        assert text == (" whale" * 4 if bias else baseline), (bias, text)


# ---- a worker that did not announce logit_bias -----------------------------------------------------


@pytest.fixture(scope="module")
def stock(two_backends: TwoBackendCluster) -> Iterator[FakeCluster]:
    # The fake worker's /model_details lists no params extensions, as a stock FastChat worker's.
    with fake_cluster() as cluster:
        yield cluster


def test_a_worker_that_did_not_announce_it_never_gets_it(stock: FakeCluster) -> None:
    client = openai.OpenAI(base_url=f"{stock.gateway}/v1", api_key="none", max_retries=0, timeout=30)
    before = stock.worker.received()
    for call in (
        lambda: client.chat.completions.create(model=FAKE_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, logit_bias={"5": -100}),
        lambda: client.completions.create(model=FAKE_MODEL, prompt="Hi", max_tokens=2, logit_bias={"5": 1},
                                          stream=True),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.param == "logit_bias" and "logit_bias" in info.value.message
    assert stock.worker.received() == before, "the request reached a worker that would drop logit_bias"
    # Without it (or with an empty map, which asks for nothing) the same worker serves.
    reply = client.chat.completions.create(model=FAKE_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, logit_bias={})
    assert reply.choices[0].message.content == fake_reply(2)
    assert "logit_bias" not in stock.worker.params[-1]


def test_our_workers_announce_it(two_backends: TwoBackendCluster) -> None:
    for backend, url in two_backends.worker_urls.items():
        details = httpx.post(f"{url}/model_details", json={"model": model_name(backend)}, timeout=10).json()
        assert "logit_bias" in details["params"]
