"""Bad fields in well-formed request bodies at the gateway: wrong types, out-of-range values,
values over the configurable caps, an unknown model, and more tokens than the context holds.
Each gets OpenAI's error envelope with its status (never a 500) naming the field, a refused
request never reaches a worker, and the server keeps serving.

A real controller, a fake worker (validating as the real one does) and the gateway, as uvicorn
servers on 127.0.0.1 (`cluster` and `http` in conftest.py). Bad bodies (JSON syntax, content type,
encoding, size) are in test_gateway_bad_body.py; cases that need a real tokenizer and model are in
test_real_model.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.badinput.conftest import USER, chat, completion, post_refused
from tests.fake_worker import CONTEXT_LENGTH, FakeCluster, fake_cluster

pytestmark = pytest.mark.usefixtures("still_serving")


# ---- fields -------------------------------------------------------------------------------------------

CHAT_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    # wrong types name the field
    ("model-number", {"model": 5}, "model"),
    ("missing-model", {"model": None}, "model"),
    ("temperature-string", {"temperature": "hot"}, "temperature"),
    ("n-float", {"n": 1.5}, "n"),
    ("stream-int", {"stream": 1}, "stream"),
    ("stop-int", {"stop": 3}, "stop"),
    ("messages-object", {"messages": {"role": "user"}}, "messages"),
    ("content-number", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("content-object", {"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    ("content-image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages[0].content[0].type"),
    ("content-part-no-text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ("role-missing", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("role-unknown", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("role-tool-without-call-id", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("user-without-content", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("messages-empty", {"messages": []}, "messages"),
    # ranges
    ("max-tokens-0", {"max_tokens": 0}, "max_tokens"),
    ("max-tokens-negative", {"max_tokens": -5}, "max_tokens"),
    ("max-completion-tokens-0", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("temperature-negative", {"temperature": -0.1}, "temperature"),
    ("temperature-above-2", {"temperature": 2.01}, "temperature"),
    ("top-p-0", {"top_p": 0}, "top_p"),
    ("top-p-above-1", {"top_p": 1.01}, "top_p"),
    ("top-k-below-minus-1", {"top_k": -2}, "top_k"),
    ("top-k-huge", {"top_k": 2**70}, "top_k"),
    ("presence-penalty-low", {"presence_penalty": -2.5}, "presence_penalty"),
    ("frequency-penalty-high", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("repetition-penalty-0", {"repetition_penalty": 0}, "repetition_penalty"),
    ("repetition-penalty-high", {"repetition_penalty": 2.5}, "repetition_penalty"),
    ("min-p-above-1", {"min_p": 1.5}, "min_p"),
    ("min-tokens-negative", {"min_tokens": -1}, "min_tokens"),
    ("seed-huge", {"seed": 2**70}, "seed"),
    ("seed-very-negative", {"seed": -(2**70)}, "seed"),
    ("stop-token-id-negative", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ("stop-token-id-huge", {"stop_token_ids": [2**40]}, "stop_token_ids[0]"),
    ("n-0", {"n": 0}, "n"),
    ("top-logprobs-21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top-logprobs-without-logprobs", {"top_logprobs": 2}, "top_logprobs"),
    # caps (defaults: n 16, 4 stop sequences of at most 256 characters)
    ("n-above-cap", {"n": 17}, "n"),
    ("stop-list-above-cap", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop-string-too-long", {"stop": "x" * 257}, "stop"),
    ("stop-list-string-too-long", {"stop": ["ok", "y" * 1000]}, "stop"),
    ("stop-empty-string", {"stop": ""}, "stop"),
    ("stop-list-with-empty-string", {"stop": ["ok", ""]}, "stop"),
    # a request may not bring its own chat template
    ("chat-template", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat-template-empty", {"chat_template": ""}, "chat_template"),
    ("chat-template-kwargs", {"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs"),
    ("chat-template-kwargs-other", {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    # constraints and tools: malformed ones name the field; valid ones reach a worker that did
    # not announce them (the fake one, like a stock FastChat worker) only as a 400 naming it
    ("response-format-json", {"response_format": {"type": "json_object"}}, "response_format"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("tool-history", {"messages": [{"role": "user", "content": "x"},
                                   {"role": "tool", "tool_call_id": "c", "content": "1"}]}, "messages"),
    ("tool-choice-required", {"tool_choice": "required"}, "tool_choice"),
    ("guided-choice", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("response-format-bad-schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ("response-format-unsupported-keyword", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}}}}}, "response_format"),
    ("response-format-unknown-type", {"response_format": {"type": "yaml"}}, "response_format"),
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("tool-duplicate-names", {"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ("tool-choice-unknown-tool", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("two-constraints", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("legacy-functions", {"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "param"), [c[1:] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_fields_are_400_with_param(
    cluster: FakeCluster, http: httpx.Client, fields: dict[str, Any], param: str | None, stream: bool
) -> None:
    error = post_refused(cluster, http, "/v1/chat/completions", 400, json=chat(**{"stream": stream, **fields}))
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"], ids=["nan", "inf", "-inf", "overflow", "-overflow"]
)
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"])
def test_non_finite_numbers_are_400(cluster: FakeCluster, http: httpx.Client, field: str, literal: str) -> None:
    raw = '{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "%s": %s}' % (field, literal)
    error = post_refused(cluster, http, "/v1/chat/completions", 400, content=raw.encode(),
                         headers={"Content-Type": "application/json"})
    assert error["param"] in (field, None), error


COMPLETION_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("prompt-missing", {"prompt": None}, "prompt"),
    ("prompt-number", {"prompt": 5}, "prompt"),
    ("prompt-empty-list", {"prompt": []}, "prompt"),
    ("prompt-mixed", {"prompt": ["a", 1]}, "prompt"),
    ("logprobs-21", {"logprobs": 21}, "logprobs"),
    ("logprobs-negative", {"logprobs": -1}, "logprobs"),
    ("max-tokens-0", {"max_tokens": 0}, "max_tokens"),
    ("best-of-not-n", {"best_of": 3}, "best_of"),
    ("suffix", {"suffix": "the end"}, "suffix"),
    ("n-above-cap", {"n": 17}, "n"),
    ("choices-above-cap", {"prompt": ["a"] * 5, "n": 4}, "prompt"),
    ("prompts-above-cap", {"prompt": ["a"] * 17}, "prompt"),
    ("stop-list-above-cap", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop-empty", {"stop": [""]}, "stop"),
    ("echo-string", {"echo": "yes"}, "echo"),
]


@pytest.mark.parametrize(("fields", "param"), [c[1:] for c in COMPLETION_CASES], ids=[c[0] for c in COMPLETION_CASES])
def test_bad_completion_fields_are_400_with_param(
    cluster: FakeCluster, http: httpx.Client, fields: dict[str, Any], param: str | None
) -> None:
    error = post_refused(cluster, http, "/v1/completions", 400, json=completion(**fields))
    assert error["param"] == param, error


@pytest.mark.parametrize(
    "prompt",
    [[1, 2, 3], [[1, 2], [3]], [49152], [10**12], [-1], [[2**40]], [[]]],
    ids=["ids", "id-lists", "vocab-size", "huge", "negative", "huge-in-list", "empty-id-list"],
)
def test_token_id_prompts_are_refused_clearly(cluster: FakeCluster, http: httpx.Client, prompt: Any) -> None:
    # Decided: the worker protocol carries text prompts, so token ids (in the vocabulary or not)
    # are refused with one clear message rather than detokenized and re-tokenized.
    error = post_refused(cluster, http, "/v1/completions", 400, json=completion(prompt=prompt))
    assert error["param"] == "prompt"
    assert "token" in error["message"] or "Input should be" in error["message"], error


def test_caps_at_the_boundary_are_accepted(cluster: FakeCluster, http: httpx.Client) -> None:
    body = chat(n=16, max_tokens=1, logprobs=True, top_logprobs=20, stop=["a" * 256, "b", "c", "d"])
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 16
    response = http.post("/v1/completions", json=completion(prompt=["a"] * 4, n=4, max_tokens=1, logprobs=20))
    assert response.status_code == 200, response.text


def test_caps_are_configurable() -> None:
    from llmplatform.openai_api.settings import RequestLimits

    limits = RequestLimits(max_n=2, max_logprobs=3, max_stop_sequences=1, max_stop_length=5)
    with fake_cluster(limits=limits) as cluster, httpx.Client(base_url=cluster.gateway, timeout=30) as http:
        for fields, param in [({"n": 3}, "n"), ({"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
                              ({"stop": ["a", "b"]}, "stop"), ({"stop": "abcdef"}, "stop")]:
            assert post_refused(cluster, http, "/v1/chat/completions", 400, json=chat(**fields))["param"] == param
        assert post_refused(cluster, http, "/v1/completions", 400, json=completion(logprobs=4))["param"] == "logprobs"
        ok = chat(n=2, logprobs=True, top_logprobs=3, stop="abcde", max_tokens=1)
        assert http.post("/v1/chat/completions", json=ok).status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_n": 0}, "max_n"), ({"max_n": 129}, "max_n"), ({"max_logprobs": 21}, "max_logprobs"),
     ({"max_stop_sequences": 17}, "max_stop_sequences"), ({"max_request_bytes": 0}, "max_request_bytes")],
)
def test_cap_settings_are_validated(kwargs: dict[str, int], message: str) -> None:
    from llmplatform.openai_api.settings import RequestLimits

    with pytest.raises(ValueError, match=message):
        RequestLimits(**kwargs)


def test_cap_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    defaults = GatewayServiceSettings.parse([]).gateway_settings.limits
    assert (defaults.max_n, defaults.max_logprobs, defaults.max_stop_sequences) == (16, 20, 4)
    assert defaults.max_stop_length == 256 and defaults.max_request_bytes == 4 * 1024 * 1024
    limits = GatewayServiceSettings.parse(["--max-n", "3", "--max-logprobs", "5", "--max-stop-sequences", "2",
                                           "--max-stop-length", "9", "--max-request-bytes", "1000"]
                                          ).gateway_settings.limits
    assert (limits.max_n, limits.max_logprobs, limits.max_stop_sequences, limits.max_stop_length,
            limits.max_request_bytes) == (3, 5, 2, 9, 1000)


# ---- models and the context ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_model_is_404(cluster: FakeCluster, http: httpx.Client, path: str) -> None:
    body = chat(model="no-such-model") if "chat" in path else completion(model="no-such-model")
    error = post_refused(cluster, http, path, 404, json=body)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_unknown_model_with_the_openai_client(cluster: FakeCluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=USER)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # The fake prompt "<user> hello there\n<assistant>" is 3 tokens: 3 + 62 > 64.
        ("/v1/chat/completions", chat(max_tokens=CONTEXT_LENGTH - 2)),
        ("/v1/chat/completions", chat(max_completion_tokens=10**9)),
        ("/v1/completions", completion(max_tokens=CONTEXT_LENGTH - 1)),  # 2 + 63 > 64
        ("/v1/completions", completion(max_tokens=2**62)),
        # A prompt that alone fills or overflows the context.
        ("/v1/completions", completion(prompt="w " * CONTEXT_LENGTH)),
        ("/v1/completions", completion(prompt="w " * (CONTEXT_LENGTH * 10), max_tokens=1)),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "w " * CONTEXT_LENGTH}])),
        ("/v1/completions", completion(prompt=["short", "w " * CONTEXT_LENGTH])),
    ],
    ids=["chat-max-tokens", "chat-max-completion-tokens", "completion-max-tokens", "completion-huge",
         "prompt-fills", "prompt-overflows", "chat-prompt-overflows", "one-of-batch-overflows"],
)
def test_beyond_the_context_is_context_length_exceeded(
    cluster: FakeCluster, http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    error = post_refused(cluster, http, path, 400, json=body)
    assert error["code"] == "context_length_exceeded", error
    assert str(CONTEXT_LENGTH) in error["message"]


def test_exactly_the_context_fits(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=completion(max_tokens=CONTEXT_LENGTH - 2))
    assert response.status_code == 200, response.text
