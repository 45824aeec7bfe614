"""Every id a request carries, out of range, negative, huge or of the wrong type, against the tiny
model (a 49152-token vocabulary) on both backends: through the gateway (the official openai
client, raw httpx for wrong types) and straight to each worker's FastChat routes. Each is refused
naming its field, and afterwards every worker's /health is 200 and each still generates.

What a refusal looks like:
- through the gateway: HTTP 400, OpenAI's error envelope, ``param`` naming the field (the gateway
  checks shapes; ranges against the vocabulary come from the worker, whose ``param`` it keeps);
- at the worker: its existing refusal shape, FastChat's: HTTP 200 and one error object
  ``{"text", "error_code", "param"}`` as the whole answer (40001 for a wrong JSON type, 40302
  for a value out of range), without the accepted header; ``param`` is our addition.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from llmplatform.protocol.worker import ACCEPTED_HEADER
from tests.badinput.conftest import BACKENDS, TINY_VOCAB_SIZE, TwoBackendCluster, model_name

V = TINY_VOCAB_SIZE
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(autouse=True)
def still_serving(two_backends: TwoBackendCluster) -> Iterator[None]:
    yield
    two_backends.assert_all_serving()


@pytest.fixture(scope="module")
def client(two_backends: TwoBackendCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{two_backends.gateway_url}/v1", api_key="none", max_retries=0, timeout=60)


# ---- through the gateway, with the official client ------------------------------------------------

# (extra_body, the param the envelope names). The first is the reported bug: an out-of-vocabulary
# stop id with min_tokens indexed the sampler's mask and killed the engine.
GATEWAY_CASES = [
    ({"min_tokens": 2, "stop_token_ids": [60000]}, "stop_token_ids"),
    ({"stop_token_ids": [60000]}, "stop_token_ids"),
    ({"stop_token_ids": [5, V]}, "stop_token_ids"),
    ({"stop_token_ids": [2**31 - 1], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids[0]"),
    ({"logit_bias": {str(V): 100}}, "logit_bias"),
    ({"logit_bias": {"60000": -100, "5": 1}}, "logit_bias"),
    ({"logit_bias": {"4294967295": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999999999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"1e3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"logit_bias": {"5": -101}}, "logit_bias.5"),
    ({"allowed_token_ids": [1, 2, 3]}, "allowed_token_ids"),
    ({"allowed_token_ids": [60000]}, "allowed_token_ids"),
    ({"bad_words": ["sea"]}, "bad_words"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extra, param", GATEWAY_CASES, ids=[json.dumps(c[0])[:50] for c in GATEWAY_CASES])
def test_out_of_range_ids_through_the_gateway(client: openai.OpenAI, backend: str, extra: dict, param: str
                                              ) -> None:
    calls = [
        lambda: client.chat.completions.create(model=model_name(backend), messages=USER, max_tokens=3,
                                               extra_body=extra),
        lambda: client.chat.completions.create(model=model_name(backend), messages=USER, max_tokens=3,
                                               extra_body=extra, stream=True),
        lambda: client.completions.create(model=model_name(backend), prompt="The sea", max_tokens=3,
                                          extra_body=extra),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.status_code == 400
        assert info.value.param == param, info.value.body
        assert param.split(".")[0].split("[")[0] in info.value.message


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt", [[60000], [1, V], [-1], [2**40], [[5, 60000]], [[1, 2], [-3]]])
def test_token_id_prompts_through_the_gateway(client: openai.OpenAI, backend: str, prompt: Any) -> None:
    # Token-id prompts are not served (refused whole, never passed on), so no id reaches a worker.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name(backend), prompt=prompt, max_tokens=2)
    assert info.value.param == "prompt"


# Wrong JSON types, which the official client would not send: raw bodies. (field, value, param)
WRONG_TYPES = [
    ("stop_token_ids", "60000", "stop_token_ids"),
    ("stop_token_ids", ["5"], "stop_token_ids[0]"),
    ("stop_token_ids", [1.5], "stop_token_ids[0]"),
    ("stop_token_ids", [True], "stop_token_ids[0]"),
    ("stop_token_ids", {"5": 1}, "stop_token_ids"),
    ("logit_bias", [5, 100], "logit_bias"),
    ("logit_bias", "5:100", "logit_bias"),
    ("logit_bias", {"5": "100"}, "logit_bias.5"),
    ("logit_bias", {"5": True}, "logit_bias.5"),
    ("logit_bias", {"5": None}, "logit_bias.5"),
    ("logit_bias", {"5": [1]}, "logit_bias.5"),
    ("min_tokens", "2", "min_tokens"),
    ("seed", "7", "seed"),
    ("seed", 1.5, "seed"),
    ("top_k", "5", "top_k"),
    ("n", "2", "n"),
    ("max_tokens", "3", "max_tokens"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field, value, param", WRONG_TYPES, ids=[f"{f}={json.dumps(v)}" for f, v, _ in WRONG_TYPES])
def test_wrong_types_through_the_gateway(two_backends: TwoBackendCluster, backend: str, field: str, value: Any,
                                         param: str) -> None:
    for path, body in [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "The sea"})]:
        body = {"model": model_name(backend), "max_tokens": 3, **body, field: value}
        response = httpx.post(f"{two_backends.gateway_url}{path}", json=body, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (path, error)


def test_in_range_ids_are_served(client: openai.OpenAI, two_backends: TwoBackendCluster) -> None:
    """The bounds are the model's: the last id of the vocabulary is a valid stop id and bias key."""
    for backend in BACKENDS:
        reply = client.chat.completions.create(
            model=model_name(backend), messages=USER, max_tokens=3,
            extra_body={"min_tokens": 2, "stop_token_ids": [0, V - 1], "logit_bias": {str(V - 1): -100}})
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 2


# ---- straight to the worker's FastChat routes ------------------------------------------------------

# (params beyond model and prompt, the field named). A value the worker must refuse: its range
# or its type. The params dict is what any FastChat-protocol client can send.
WORKER_CASES = [
    ({"min_tokens": 2, "stop_token_ids": [60000]}, "stop_token_ids"),
    ({"stop_token_ids": [V]}, "stop_token_ids"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": "5"}, "stop_token_ids"),
    ({"logit_bias": {"60000": 5}}, "logit_bias"),
    ({"logit_bias": {str(V): -100}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"99999999999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"min_tokens": 9, "max_new_tokens": 3}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "2"}, "min_tokens"),
    ({"max_new_tokens": 10**30}, "max_tokens"),
    ({"max_new_tokens": 0}, "max_tokens"),
    ({"max_new_tokens": "5"}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"top_k": -5}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "2"}, "logprobs"),
    ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
    ({"best_of": 4}, "best_of"),
    ({"best_of": "2"}, "best_of"),
    ({"request_id": "x" * 300}, "request_id"),
    ({"request_id": "two\nlines"}, "request_id"),
    ({"request_id": ""}, "request_id"),
    ({"request_id": 5}, "request_id"),
    ({"stop": ["x" * 2000]}, "stop"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"temperature": "hot"}, "temperature"),
    ({"echo": "yes"}, "echo"),
    ({"openai_max_tokens": {"requested": "5"}}, "openai_max_tokens"),
]


def _refusal(response: httpx.Response) -> dict[str, Any]:
    """The worker's refusal: HTTP 200, no accepted header, one FastChat error object."""
    assert response.status_code == 200, response.text
    assert ACCEPTED_HEADER not in response.headers
    frames = [f for f in response.content.split(b"\0") if f.strip()]
    assert len(frames) == 1, frames
    error = json.loads(frames[0])
    assert error["error_code"] in (40001, 40302, 40303), error
    return error


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params, field", WORKER_CASES, ids=[json.dumps(c[0])[:50] for c in WORKER_CASES])
def test_out_of_range_or_wrong_type_straight_to_the_worker(two_backends: TwoBackendCluster, backend: str,
                                                           params: dict, field: str) -> None:
    url = two_backends.worker_urls[backend]
    body = {"model": model_name(backend), "prompt": "The sea", "max_new_tokens": 3, "echo": False, **params}
    for route in ("/worker_generate_stream", "/worker_generate"):
        error = _refusal(httpx.post(f"{url}{route}", json=body, timeout=60))
        assert error["param"].startswith(field), (route, error)
        assert field in error["text"], (route, error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chat_messages_straight_to_the_worker(two_backends: TwoBackendCluster, backend: str) -> None:
    # Our single-call path (the worker renders and sizes): the same checks, before generating.
    url = two_backends.worker_urls[backend]
    for extra, field in [({"min_tokens": 2, "stop_token_ids": [60000]}, "stop_token_ids"),
                         ({"logit_bias": {"60000": 1}}, "logit_bias")]:
        body = {"model": model_name(backend), "messages": USER, "echo": False,
                "openai_max_tokens": {"requested": 3, "param": "messages"}, **extra}
        error = _refusal(httpx.post(f"{url}/worker_generate_stream", json=body, timeout=60))
        assert error["param"] == field


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("raw", [
    b'{"model": "M", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}",  # past Python's int-digits limit
    b'{"model": "M", "prompt": "x", "stop_token_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "M", "prompt": "x", "temperature": NaN}',
    b'{"model": "M", "prompt": "x", "logit_bias": {"5": Infinity}}',
    b"\xff\xfe{}",
], ids=["5000-digit-seed", "deep-nesting", "nan", "infinite-bias", "bad-utf8"])
def test_malformed_bodies_straight_to_the_worker(two_backends: TwoBackendCluster, backend: str, raw: bytes) -> None:
    url = two_backends.worker_urls[backend]
    raw = raw.replace(b'"M"', json.dumps(model_name(backend)).encode())
    for route in ("/worker_generate_stream", "/worker_generate"):
        response = httpx.post(f"{url}{route}", content=raw, headers={"Content-Type": "application/json"},
                              timeout=60)
        _refusal(response)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_range_ids_straight_to_the_worker(two_backends: TwoBackendCluster, backend: str) -> None:
    url = two_backends.worker_urls[backend]
    body = {"model": model_name(backend), "prompt": "The sea", "max_new_tokens": 3, "echo": False,
            "temperature": 0, "min_tokens": 2, "stop_token_ids": [V - 1], "logit_bias": {"0": -100},
            "seed": 2**64 - 1, "top_k": 10**30, "request_id": "a" * 256}
    last = httpx.post(f"{url}/worker_generate", json=body, timeout=60).json()
    assert last["error_code"] == 0 and last["finish_reason"] in ("stop", "length"), last
