"""/v1/embeddings end to end: a real cluster (controller, gateway, an embedding worker serving the
packaged all-MiniLM-L6-v2, a chat worker serving the tiny Llama), the official ``openai`` client,
and sentence-transformers on the same files as the reference."""

from __future__ import annotations

import base64
import concurrent.futures
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.protocol.worker import MAX_EMBEDDING_INPUTS
from tests.integration.cluster import Cluster, paged_tiny_llm, running_cluster

EMBED = "minilm"
CHAT = "tiny"
TIMEOUT_S = 60.0

_WORDS = ("the sea river mountain quick brown fox jumps over lazy dog embeddings vectors search "
          "retrieval of documents about cooking physics history music a an is was were to from "
          "with language models serve requests batch tokens Zürich café naïve 東京 12 345").split()


def sentences(count: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """Deterministic sentences from 1 to ``max_words`` words (all within the 256-token limit)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words))) + "."
            for _ in range(count)]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def cluster(embedding_model_dir: Path, tiny_model_dir: Path) -> Iterator[Cluster]:
    with running_cluster() as cluster:
        # --backend auto: the folder says it is an embedding model.
        cluster.add_worker(build_backend(BackendConfig(model_path=str(embedding_model_dir),
                                                   model_names=(EMBED,), device="cpu")))
        cluster.add_worker(paged_tiny_llm(tiny_model_dir))
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client(timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(embedding_model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_model_dir), device="cpu")


@pytest.fixture(scope="module")
def tokenizer(embedding_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedding_model_dir))


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def raw_embeddings(cluster: Cluster, **body) -> httpx.Response:
    return httpx.post(f"{cluster.gateway_url}/v1/embeddings", json=body, timeout=TIMEOUT_S)


# ---- parity ----------------------------------------------------------------------------------


def test_parity_with_sentence_transformers(client: openai.OpenAI, reference, tokenizer) -> None:
    texts = sentences(100)
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    floats = client.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    got = vectors(floats)
    assert got.shape == (100, 384)
    assert cosine(got, expected).min() >= 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(
        len(ids) for ids in tokenizer(texts)["input_ids"])
    # The openai client asks for base64 by default and decodes it: the same float32 vectors.
    decoded = vectors(client.embeddings.create(model=EMBED, input=texts))
    np.testing.assert_array_equal(decoded, got)


def test_a_vector_does_not_depend_on_its_batch(client: openai.OpenAI) -> None:
    texts = sentences(16, seed=1)
    together = vectors(client.embeddings.create(model=EMBED, input=texts, encoding_format="float"))
    alone = np.stack([vectors(client.embeddings.create(model=EMBED, input=t, encoding_format="float"))[0]
                      for t in texts[:4]])
    # And one short sentence padded beside the longest ones, from many concurrent requests.
    longest = sorted(texts, key=len)[-8:]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda t: vectors(client.embeddings.create(
            model=EMBED, input=[texts[0], t], encoding_format="float"))[0], longest))
    assert (1 - cosine(alone, together[:4])).max() <= 1e-5
    assert (1 - cosine(np.stack(mixed), together[0])).max() <= 1e-5


def test_concurrent_single_sentence_requests(client: openai.OpenAI, reference) -> None:
    texts = sentences(48, seed=2)
    expected = reference.encode(texts, convert_to_numpy=True)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = np.stack(list(pool.map(
            lambda t: vectors(client.embeddings.create(model=EMBED, input=t))[0], texts)))
    assert cosine(got, expected).min() >= 0.9999


# ---- the request's shapes ---------------------------------------------------------------------


def test_inputs_as_token_ids(client: openai.OpenAI, tokenizer) -> None:
    texts = ["hello world", "a second, longer sentence about the sea"]
    by_text = vectors(client.embeddings.create(model=EMBED, input=texts, encoding_format="float"))
    ids = tokenizer(texts)["input_ids"]
    one = vectors(client.embeddings.create(model=EMBED, input=ids[0], encoding_format="float"))
    lists = client.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    np.testing.assert_allclose(one[0], by_text[0], atol=1e-6)
    np.testing.assert_allclose(vectors(lists), by_text, atol=1e-6)
    assert lists.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_empty_string_is_embedded_and_base64_is_float32(cluster: Cluster) -> None:
    response = raw_embeddings(cluster, model=EMBED, input=["", "x"], encoding_format="base64",
                              user="someone")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == EMBED
    assert [d["index"] for d in body["data"]] == [0, 1]
    first = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert first.shape == (384,) and abs(float(np.linalg.norm(first)) - 1) < 1e-5
    assert body["usage"] == {"prompt_tokens": 2 + 3, "total_tokens": 2 + 3}  # [CLS] [SEP] (+ x)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[10 ** 6]]}, "input"),
    ({"input": "x", "dimensions": 64}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(cluster: Cluster, body: dict, param: str) -> None:
    error = _error(raw_embeddings(cluster, model=EMBED, **body))
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_the_input_cap_is_inclusive(client: openai.OpenAI) -> None:
    response = client.embeddings.create(model=EMBED, input=["x"] * MAX_EMBEDDING_INPUTS)
    assert len(response.data) == MAX_EMBEDDING_INPUTS


def test_an_input_over_the_length_is_refused_unless_truncation_is_asked(
        cluster: Cluster, client: openai.OpenAI, reference, tokenizer) -> None:
    long_text = " ".join(["word"] * 400)  # ~400 tokens; the model takes 256
    error = _error(raw_embeddings(cluster, model=EMBED, input=["short", long_text]))
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert "256" in error["message"] and "truncate_prompt_tokens" in error["message"]
    cut = client.embeddings.create(model=EMBED, input=[long_text], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": -1})
    assert cut.usage.prompt_tokens == 256
    # sentence-transformers truncates to max_seq_length on its own: the same vector.
    assert cosine(vectors(cut), reference.encode([long_text])).min() >= 0.9999
    shorter = client.embeddings.create(model=EMBED, input=[long_text],
                                       extra_body={"truncate_prompt_tokens": 10})
    assert shorter.usage.prompt_tokens == 10


def test_wrong_model_kind_is_a_400_that_says_why(cluster: Cluster, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as chat_to_embedder:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert "embedding model" in str(chat_to_embedder.value)
    with pytest.raises(openai.BadRequestError) as completion_to_embedder:
        client.completions.create(model=EMBED, prompt="hi", max_tokens=4)
    assert "embedding model" in str(completion_to_embedder.value)
    error = _error(raw_embeddings(cluster, model=CHAT, input="hi"))
    assert error["param"] == "model" and "serves no embeddings" in error["message"]
    error = _error(raw_embeddings(cluster, model="nope", input="hi"), status=404)
    assert error["code"] == "model_not_found"


def test_models_list_what_they_serve(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list()}
    assert cards[EMBED].model_extra["tasks"] == ["embed"]
    assert cards[CHAT].model_extra["tasks"] == ["generate"]


def test_the_worker_keeps_serving_after_refusals(cluster: Cluster, client: openai.OpenAI) -> None:
    for body in ({"input": []}, {"input": " ".join(["w"] * 400)}, {"input": [[-1]]}):
        assert raw_embeddings(cluster, model=EMBED, **body).status_code == 400
    assert len(client.embeddings.create(model=EMBED, input=["still here"]).data) == 1
    status = httpx.post(f"{cluster.worker_urls[EMBED]}/worker_get_status", timeout=5).json()
    assert status["num_accepted"] == 0 and status["tasks"] == ["embed"]
    details = httpx.post(f"{cluster.worker_urls[EMBED]}/model_details", json={}, timeout=5).json()
    assert details["embedding"] == {"dimensions": 384, "max_input_tokens": 256, "normalized": True,
                                    "matryoshka_dimensions": None}
