"""Property tests (hypothesis): whatever a client sends, the gateway answers with a success or
OpenAI's error envelope with a 4xx status, never a 500, and keeps serving.

Requests go over real sockets to a real gateway and controller with the fake worker (which
validates as the real worker does); test_real_model.py runs a smaller sample against a real
model. Example counts are modest so the whole file takes seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_worker import MODEL, FakeCluster

PATHS = ["/v1/chat/completions", "/v1/completions"]
CLIENT_ERRORS = {400, 404, 413}
PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples every run: CI failures reproduce
    database=None,  # and nothing written into the working tree
)

# ---- strategies ------------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)
# Numbers around every range boundary the API has (0, 1, 2, -1, -2, 20, 128, ...).
edge_numbers = st.one_of(
    st.sampled_from([0, 1, 2, -1, -2, 5, 16, 17, 20, 21, 64, 128, 129, 2**31, 2**63, 2**64, -(2**63) - 1]),
    st.floats(min_value=-3, max_value=3, allow_nan=False),
    st.sampled_from([0.0, 1.0, 2.0, 1e-9, -0.0, 1e308]),
    st.integers(min_value=-5, max_value=200),
)
short_text = st.text(max_size=30)
maybe_bad = st.one_of(json_values, edge_numbers, short_text)

stop = st.one_of(st.none(), short_text, st.lists(st.text(max_size=300), max_size=6), maybe_bad)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "USER"]) | maybe_bad},
    optional={
        "content": st.one_of(
            short_text,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | maybe_bad},
                                           optional={"text": short_text | maybe_bad}), max_size=3),
            maybe_bad,
        ),
        "name": short_text | maybe_bad,
    },
)
sampling_fields = {
    "temperature": edge_numbers | maybe_bad,
    "top_p": edge_numbers | maybe_bad,
    "top_k": edge_numbers | maybe_bad,
    "min_p": edge_numbers,
    "n": edge_numbers | maybe_bad,
    "max_tokens": edge_numbers | maybe_bad,
    "stop": stop,
    "stream": st.booleans() | maybe_bad,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | maybe_bad}) | maybe_bad,
    "presence_penalty": edge_numbers,
    "frequency_penalty": edge_numbers,
    "repetition_penalty": edge_numbers,
    "seed": edge_numbers | maybe_bad,
    "stop_token_ids": st.lists(edge_numbers, max_size=3) | maybe_bad,
    "ignore_eos": st.booleans() | maybe_bad,
    "min_tokens": edge_numbers,
    "user": short_text | maybe_bad,
    "unknown_field": maybe_bad,
}
chat_requests = st.fixed_dictionaries(
    {"model": st.just(MODEL) | maybe_bad, "messages": st.lists(message, max_size=3) | maybe_bad},
    optional={
        **sampling_fields,
        "max_completion_tokens": edge_numbers | maybe_bad,
        "logprobs": st.booleans() | maybe_bad,
        "top_logprobs": edge_numbers | maybe_bad,
        "chat_template": st.none() | short_text,
        "chat_template_kwargs": st.none() | json_values,
    },
)
completion_requests = st.fixed_dictionaries(
    {"model": st.just(MODEL) | maybe_bad,
     "prompt": st.one_of(short_text, st.lists(short_text, max_size=20), st.lists(edge_numbers, max_size=3), maybe_bad)},
    optional={
        **sampling_fields,
        "echo": st.booleans() | maybe_bad,
        "logprobs": edge_numbers | maybe_bad,
        "suffix": st.none() | short_text,
        "best_of": edge_numbers,
    },
)


# ---- the checks ------------------------------------------------------------------------------------


# `cluster` (a fake worker behind the real gateway) comes from tests/badinput/conftest.py.


@pytest.fixture(scope="module")
def http(cluster: FakeCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.gateway, timeout=30) as client:
        yield client
        # And after everything, the server still serves.
        ok = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text


def check_answer(response: httpx.Response) -> None:
    """A 200 with a well-formed body (or stream ending in [DONE]), or a 4xx envelope."""
    status = response.status_code
    assert status == 200 or status in CLIENT_ERRORS, (status, response.text[:500])
    if status != 200:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in response.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            data = json.loads(event.removeprefix("data: "))
            assert "error" not in data, data  # the fake worker never fails mid-stream
    else:
        data = response.json()
        assert data["choices"] and "usage" in data, data


def post_json(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    # allow_nan: NaN/Infinity are not JSON, but clients send them (json.dumps does by default).
    raw = json.dumps(body, allow_nan=True).encode()
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


@PROPERTY_SETTINGS
@given(body=chat_requests)
def test_chat_requests_never_500(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(post_json(http, "/v1/chat/completions", body))


@PROPERTY_SETTINGS
@given(body=completion_requests)
def test_completion_requests_never_500(http: httpx.Client, body: dict[str, Any]) -> None:
    check_answer(post_json(http, "/v1/completions", body))


@PROPERTY_SETTINGS
@given(path=st.sampled_from(PATHS), body=json_values)
def test_any_json_value_never_500(http: httpx.Client, path: str, body: Any) -> None:
    check_answer(post_json(http, path, body))


@PROPERTY_SETTINGS
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=200))
def test_any_bytes_never_500(http: httpx.Client, path: str, raw: bytes) -> None:
    check_answer(http.post(path, content=raw, headers={"Content-Type": "application/json"}))


@PROPERTY_SETTINGS
@given(
    path=st.sampled_from(PATHS),
    field=st.sampled_from(["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                           "min_p", "top_k", "n", "max_tokens", "seed"]),
    value=st.floats(allow_nan=True, allow_infinity=True) | st.integers(min_value=-(2**100), max_value=2**100),
)
def test_any_number_in_a_numeric_field_never_500(http: httpx.Client, path: str, field: str, value: float) -> None:
    body: dict[str, Any] = {"model": MODEL, field: value, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    if field == "max_tokens":
        body["max_tokens"] = value
    response = post_json(http, path, body)
    check_answer(response)
    if isinstance(value, float) and not math.isfinite(value):
        assert response.status_code == 400
