"""Property test (hypothesis) over a real worker's own request body: whatever params dict a
FastChat-protocol client sends to `/worker_generate` or `/worker_generate_stream`, on either
backend, the answer is output or a refusal (an error object or a 4xx, never a 5xx), and
afterwards the worker's /health is 200 and it still generates.

Bodies mix valid values with values just outside every range, huge numbers, wrong JSON types and
token ids around the tiny model's 49152-token vocabulary. Generations are kept short (a few
tokens) so the whole sample runs in well under a minute.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.badinput.conftest import BACKENDS, TINY_VOCAB_SIZE, TwoBackendCluster, model_name
from tests.badinput.test_properties import edge_numbers, json_values, maybe_bad, short_text

MAX_NEW_TOKENS = 3

token_ids = st.one_of(
    st.integers(min_value=0, max_value=TINY_VOCAB_SIZE - 1),
    st.sampled_from([TINY_VOCAB_SIZE - 1, TINY_VOCAB_SIZE, 60000, -1, 2**31, 2**63, 2**64, 10**30]),
)
token_keys = st.one_of(token_ids.map(str), st.sampled_from(["", "-0", "1.5", "1e3", " 7", "abc", "٣"]))
biases = st.one_of(st.floats(min_value=-100, max_value=100), st.sampled_from([-101, 100.5, 1e308]), maybe_bad)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | maybe_bad,
                                           "content": short_text | maybe_bad}), max_size=3)

worker_fields = {
    "prompt": short_text | maybe_bad,
    "messages": messages | maybe_bad,
    "temperature": edge_numbers | maybe_bad,
    "top_p": edge_numbers | maybe_bad,
    "top_k": edge_numbers | maybe_bad,
    "min_p": edge_numbers,
    "presence_penalty": edge_numbers,
    "frequency_penalty": edge_numbers,
    "repetition_penalty": edge_numbers,
    "max_new_tokens": edge_numbers | maybe_bad,
    "min_tokens": edge_numbers | maybe_bad,
    "echo": st.booleans() | maybe_bad,
    "logprobs": edge_numbers | st.booleans() | maybe_bad,
    "prompt_logprobs": edge_numbers | maybe_bad,
    "stop": st.none() | short_text | st.lists(st.text(max_size=40), max_size=5) | maybe_bad,
    "stop_token_ids": st.lists(token_ids, max_size=3) | maybe_bad,
    "logit_bias": st.dictionaries(token_keys, biases, max_size=3) | maybe_bad,
    "seed": edge_numbers | maybe_bad,
    "best_of": edge_numbers | maybe_bad,
    "use_beam_search": st.booleans() | maybe_bad,
    "ignore_eos": st.booleans() | maybe_bad,
    "skip_special_tokens": st.booleans() | maybe_bad,
    "request_id": st.text(max_size=20) | maybe_bad,
    "images": st.none() | maybe_bad,
    "openai_max_tokens": st.fixed_dictionaries({}, optional={"requested": edge_numbers | maybe_bad,
                                                             "default": edge_numbers,
                                                             "param": st.sampled_from(["prompt", "messages"]) | maybe_bad}),
}
worker_bodies = st.fixed_dictionaries({"model": st.just("MODEL") | maybe_bad}, optional=worker_fields)


def bounded(body: dict[str, Any], backend: str) -> dict[str, Any]:
    """Short generations: a valid length above MAX_NEW_TOKENS becomes MAX_NEW_TOKENS (lengths
    beyond the context stay, to be refused), and so does the default one."""
    body = dict(body)
    if body.get("model") == "MODEL":
        body["model"] = model_name(backend)
    value = body.get("max_new_tokens")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and MAX_NEW_TOKENS < value <= 512):
        body["max_new_tokens"] = MAX_NEW_TOKENS
    budget = body.get("openai_max_tokens")
    if isinstance(budget, dict):
        budget = dict(budget)
        requested = budget.get("requested")
        if requested is None or (isinstance(requested, int) and not isinstance(requested, bool)
                                 and MAX_NEW_TOKENS < requested <= 512):
            budget["requested"] = MAX_NEW_TOKENS
        body["openai_max_tokens"] = budget
    return body


def check_worker_answer(response: httpx.Response) -> None:
    # 200 (output, or FastChat's refusal object), or a refusal before reading the body (413 over
    # a size cap, 429 a full queue): never a 5xx.
    assert response.status_code in (200, 413, 429), (response.status_code, response.text[:300])
    frames = [f for f in response.content.split(b"\0") if f.strip()]
    assert frames, "an empty answer"
    for frame in frames:
        data = json.loads(frame)
        # Output, or a client error: never an internal error (50001) for anything a client sent.
        assert data.get("error_code", 0) in (0, 40001, 40301, 40302, 40303), data


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=worker_bodies, backend=st.sampled_from(BACKENDS),
       route=st.sampled_from(["/worker_generate", "/worker_generate_stream"]))
def test_no_worker_body_hurts_the_worker(two_backends: TwoBackendCluster, body: dict[str, Any], backend: str,
                                         route: str) -> None:
    url = two_backends.worker_urls[backend]
    raw = json.dumps(bounded(body, backend), allow_nan=True).encode()
    check_worker_answer(httpx.post(f"{url}{route}", content=raw, headers={"Content-Type": "application/json"},
                                   timeout=60))
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200, health.text


def test_and_afterwards_every_worker_serves(two_backends: TwoBackendCluster) -> None:
    two_backends.assert_all_serving()


def test_any_json_value_as_the_whole_body(two_backends: TwoBackendCluster) -> None:
    @settings(max_examples=30, deadline=None, derandomize=True, database=None)
    @given(body=json_values, backend=st.sampled_from(BACKENDS))
    def check(body: Any, backend: str) -> None:
        url = two_backends.worker_urls[backend]
        check_worker_answer(httpx.post(f"{url}/worker_generate_stream", content=json.dumps(body).encode(),
                                       headers={"Content-Type": "application/json"}, timeout=60))

    check()
    two_backends.assert_all_serving()
