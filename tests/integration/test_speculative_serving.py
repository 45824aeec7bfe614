"""Speculative decoding served end to end: a worker started with --speculative-config (the tiny
model; n-gram proposals, or the tiny model drafting for itself) answers the official client
exactly as a plain worker does, streaming or not, and its /metrics count the proposals it verified
and kept."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.cluster import paged_tiny_llm, running_cluster

# Three strongly favoured tokens: the tiny random model's output becomes a walk over them, full of
# repeated n-grams that the proposer finds (the same bias in both workers).
BIAS = {"100": 9, "200": 9, "300": 9}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculating_worker_matches_a_plain_one_and_reports_acceptance(tiny_model_dir, method):
    config = SPEC if method == "ngram" else {"model": str(tiny_model_dir), "num_speculative_tokens": 4}
    with running_cluster() as cluster:
        cluster.add_worker(paged_tiny_llm(tiny_model_dir))
        spec_url = cluster.add_worker(paged_tiny_llm(tiny_model_dir, model_names=("spec",),
                                                     speculative_config=json.dumps(config)))
        client = cluster.openai_client(timeout_s=120)
        prompts = ["one two three one two three", "a quiet morning by the lake"]
        for prompt in prompts:
            kwargs = dict(prompt=prompt, max_tokens=40, temperature=0, logit_bias=BIAS, logprobs=1)
            plain = client.completions.create(model="tiny", **kwargs)
            spec = client.completions.create(model="spec", **kwargs)
            assert spec.choices[0].text == plain.choices[0].text
            assert spec.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens
            assert spec.usage.completion_tokens == plain.usage.completion_tokens == 40
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="spec", stream=True, **kwargs) if chunk.choices)
            assert streamed == plain.choices[0].text
        metrics = httpx.get(f"{spec_url}/metrics", timeout=10).text
        proposed = _metric(metrics, "llmplatform:spec_decode_num_draft_tokens_total")
        accepted = _metric(metrics, "llmplatform:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= proposed
        assert _metric(metrics, "llmplatform:spec_decode_acceptance_rate") == accepted / proposed
        assert 1 < _metric(metrics, "llmplatform:spec_decode_tokens_per_step") <= 5
