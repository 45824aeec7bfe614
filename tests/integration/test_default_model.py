"""The embedded default model (SmolLM2-135M-Instruct, native paged engine) through the whole stack,
next to a second worker serving another model with the HF backend behind the same gateway."""

from __future__ import annotations

import pytest

from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.llm.paged import PagedLLM
from llmplatform.llm.build import BackendConfig, build_backend
from tests.integration.cluster import running_cluster

pytestmark = pytest.mark.slow  # the real default model, served


@pytest.fixture(scope="module")
def two_model_cluster(tiny_model_dir):
    smol = build_backend(BackendConfig(device="cpu", kv_cache_memory="256MiB"))  # default: paged, bf16
    assert isinstance(smol, PagedLLM)
    tiny = HFTransformersLLM(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32")
    with running_cluster() as cluster:
        cluster.add_worker(smol)
        cluster.add_worker(tiny)
        yield cluster, tiny


def test_two_models_behind_one_gateway_and_paris(two_model_cluster):
    cluster, tiny = two_model_cluster
    client = cluster.openai_client()
    assert sorted(m.id for m in client.models.list()) == ["SmolLM2-135M-Instruct", "tiny"]

    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=30,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # its chat template's EOS (<|im_end|>) works

    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=30, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        if c.choices)
    assert streamed == reply.choices[0].message.content

    # The tiny model's answer (random weights) is what the tiny worker itself produces.
    tiny_reply = client.completions.create(model="tiny", prompt="The capital of France is",
                                           temperature=0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
    smol_reply = client.completions.create(model="SmolLM2-135M-Instruct",
                                           prompt="The capital of France is", temperature=0,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert tiny_reply.model == "tiny" and smol_reply.model == "SmolLM2-135M-Instruct"
    assert tiny_reply.choices[0].text != smol_reply.choices[0].text
    assert "Paris" in smol_reply.choices[0].text
