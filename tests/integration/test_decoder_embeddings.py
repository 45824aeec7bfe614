"""Decoder embeddings end to end: the tiny random Llama served by the paged backend with
``--task embed`` behind a real controller and gateway, the official ``openai`` client, vectors
checked against transformers' last hidden state (after the final norm) computed here; Matryoshka
``dimensions`` on a folder whose config allows them; chat to an embedding model refused by the
gateway; ``--backend auto`` on a sentence-transformers decoder folder; the encoder backend's
batcher gathering concurrent one-sentence requests into one batch; the startup summaries."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from llmplatform.model_worker.app import WorkerSettings
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.model_worker.__main__ import worker_summary
from tests.integration.cluster import Cluster, running_cluster

MODEL = "tiny-embed"
TIMEOUT_S = 60.0
TEXTS = ["hello", "a somewhat longer sentence about rivers and the sea",
         "Zürich café naïve 東京 " * 12, "x"]


def _copy_with(tiny_model_dir: Path, dest: Path, config_extra: dict) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(config_extra)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def mrl_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a config allowing 32- and 16-dimensional truncation (Matryoshka)."""
    return _copy_with(tiny_model_dir, tmp_path_factory.mktemp("mrl") / "tiny",
                      {"matryoshka_dimensions": [32, 16]})


@pytest.fixture(scope="module")
def cluster(mrl_dir: Path) -> Iterator[Cluster]:
    with running_cluster() as cluster:
        cluster.add_worker(build_backend(BackendConfig(
            model_path=str(mrl_dir), model_names=(MODEL,), backend="paged", task="embed",
            device="cpu", dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)))
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client(timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, tokenizer) -> np.ndarray:
    """transformers' final hidden state (after the norm) of each text's last token, normalized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for ids in tokenizer(TEXTS)["input_ids"]:
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            rows.append(torch.nn.functional.normalize(hidden[-1].float(), dim=0).numpy())
    return np.stack(rows)


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_vectors_through_the_gateway_match_transformers(client: openai.OpenAI, tokenizer,
                                                         expected: np.ndarray) -> None:
    # The third text (~100 tokens) is longer than the worker's 64-token step: it is chunked.
    response = client.embeddings.create(model=MODEL, input=TEXTS)  # base64, decoded by the client
    got = vectors(response)
    assert got.shape == (len(TEXTS), 64)
    cosine = (got * expected).sum(1)  # both unit length
    assert cosine.min() >= 1 - 1e-4
    np.testing.assert_allclose(got, expected, atol=1e-4)
    token_ids = tokenizer(TEXTS)["input_ids"]
    assert max(len(ids) for ids in token_ids) > 64
    assert response.usage.prompt_tokens == sum(len(ids) for ids in token_ids)
    by_ids = vectors(client.embeddings.create(model=MODEL, input=token_ids, encoding_format="float"))
    np.testing.assert_allclose(by_ids, got, atol=1e-5)


def test_matryoshka_dimensions(client: openai.OpenAI, cluster: Cluster, expected: np.ndarray) -> None:
    cut = vectors(client.embeddings.create(model=MODEL, input=TEXTS[:2], dimensions=16))
    assert cut.shape == (2, 16)
    first16 = expected[:2, :16] / np.linalg.norm(expected[:2, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, first16, atol=1e-4)
    refused = httpx.post(f"{cluster.gateway_url}/v1/embeddings", timeout=TIMEOUT_S,
                         json={"model": MODEL, "input": "x", "dimensions": 17})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "dimensions" and "[32, 16]" in error["message"]
    details = httpx.post(f"{cluster.worker_urls[MODEL]}/model_details", json={}, timeout=5).json()
    assert details["tasks"] == ["embed"]
    assert details["embedding"] == {"dimensions": 64, "max_input_tokens": 512, "normalized": True,
                                    "matryoshka_dimensions": [32, 16]}


def test_chat_to_an_embedding_model_is_refused_by_the_gateway(client: openai.OpenAI) -> None:
    # The gateway's own refusal (it names /v1/models), before anything is sent for generation.
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in str(chat.value) and "/v1/models" in str(chat.value)
    assert chat.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert "/v1/models" in str(completion.value)
    assert {m.id: m.model_extra["tasks"] for m in client.models.list()}[MODEL] == ["embed"]
    assert len(client.embeddings.create(model=MODEL, input="still serving").data) == 1


def test_the_worker_refuses_generation_too(cluster: Cluster) -> None:
    response = httpx.post(f"{cluster.worker_urls[MODEL]}/worker_generate", timeout=TIMEOUT_S,
                          json={"model": MODEL, "prompt": "hi", "max_new_tokens": 2})
    assert "embedding model" in response.text


def test_backend_auto_serves_a_sentence_transformers_decoder_folder_on_the_engine(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with(tiny_model_dir, tmp_path / "st-decoder", {})
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 100}))
    llm = build_backend(BackendConfig(model_path=str(folder), device="cpu", dtype="float32",
                                  kv_cache_memory="16MiB"))
    try:
        assert llm.backend_name == "paged" and [str(t) for t in llm.facts.tasks] == ["embed"]
        assert llm.embedding.pooling.mode == "mean" and not llm.embedding.pooling.normalize
        assert llm.facts.embedding.max_input_tokens == 100
        summary = worker_summary(llm, WorkerSettings(register=False), "http://127.0.0.1:1")
        assert summary["serves"] == "embed" and "blocks" in summary["kv_cache"]
    finally:
        asyncio.run(llm.shutdown())
    with pytest.raises(ValueError, match="--pooling last"):
        build_backend(BackendConfig(model_path=str(tiny_model_dir), pooling="last", device="cpu"))


def test_the_encoder_batches_concurrent_single_sentence_requests(embedding_model_dir: Path) -> None:
    llm = build_backend(BackendConfig(model_path=str(embedding_model_dir), device="cpu"))
    summary = worker_summary(llm, WorkerSettings(register=False), "http://127.0.0.1:1")
    assert summary["serves"] == "embed" and summary["kv_cache"] == "none (embeddings only)"
    sentences = [f"sentence number {i} about the sea" for i in range(16)]
    ids = llm.embedding_token_ids_sync(sentences, None)

    async def main() -> list:
        await llm.start()
        try:
            # Sixteen requests of one sentence each, arriving together.
            return await asyncio.gather(*(llm.embed([one]) for one in ids))
        finally:
            await llm.shutdown()

    results = asyncio.run(main())
    batcher = llm._batcher
    assert batcher.num_batched_inputs == 16
    assert batcher.num_batches == 1 and batcher.max_batch_inputs == 16
    assert all(len(r) == 1 and r[0].vector.shape == (384,) for r in results)


def test_a_bare_mistral_model_checkpoint_embeds_like_transformers(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """e5-mistral's shape: a ``MistralModel`` checkpoint (no LM head, names without ``model.``),
    served on the engine by --backend auto as an embedding model; generation is refused."""
    from transformers import AutoTokenizer, MistralConfig, MistralModel

    torch.manual_seed(1)
    folder = tmp_path / "tiny-e5-mistral"
    reference = MistralModel(MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, vocab_size=49152,
        sliding_window=None, initializer_range=0.2)).eval()
    reference.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(folder))
    llm = build_backend(BackendConfig(model_path=str(folder), device="cpu", dtype="float32",
                                  kv_cache_memory="16MiB"))
    ids = llm.embedding_token_ids_sync(TEXTS, None)

    async def embed() -> list:
        await llm.start()
        try:
            return await llm.embed(ids)
        finally:
            await llm.shutdown()

    assert llm.backend_name == "paged" and [str(t) for t in llm.facts.tasks] == ["embed"]
    got = np.stack([r.vector for r in asyncio.run(embed())])
    with torch.inference_mode():
        expected = np.stack([torch.nn.functional.normalize(
            reference(torch.tensor([one])).last_hidden_state[0, -1], dim=0).numpy() for one in ids])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    with pytest.raises(ValueError, match="no LM head"):
        build_backend(BackendConfig(model_path=str(folder), task="generate", device="cpu"))
