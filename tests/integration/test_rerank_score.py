"""/v1/rerank and /v1/score end to end: a real cluster (controller, gateway, a cross-encoder
worker serving a tiny random BertForSequenceClassification, an embedding worker serving the
packaged all-MiniLM-L6-v2, a chat worker serving the tiny Llama), httpx (the ``openai`` client
has no rerank), and sentence-transformers' ``CrossEncoder`` and ``SentenceTransformer`` on the
same folders as the reference."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.protocol.worker import MAX_SCORE_PAIRS
from tests.conftest import TINY_CROSS_ENCODER_POSITIONS
from tests.integration.cluster import Cluster, paged_tiny_llm, running_cluster
from tests.integration.test_embeddings import sentences

RERANK = "reranker"
EMBED = "minilm"
CHAT = "tiny"
TIMEOUT_S = 60.0

QUERY = "what is the capital of france"
DOCUMENTS = sentences(12, seed=7, max_words=25)


@pytest.fixture(scope="module")
def cross_encoder_llm(tiny_cross_encoder_dir: Path):
    # --backend auto: the folder's architecture says it is a cross-encoder.
    return build_backend(BackendConfig(model_path=str(tiny_cross_encoder_dir),
                                       model_names=(RERANK,), device="cpu"))


@pytest.fixture(scope="module")
def cluster(cross_encoder_llm, embedding_model_dir: Path, tiny_model_dir: Path) -> Iterator[Cluster]:
    with running_cluster() as cluster:
        cluster.add_worker(cross_encoder_llm)
        cluster.add_worker(build_backend(BackendConfig(model_path=str(embedding_model_dir),
                                                       model_names=(EMBED,), device="cpu")))
        cluster.add_worker(paged_tiny_llm(tiny_model_dir))
        yield cluster


@pytest.fixture(scope="module")
def cross_encoder(tiny_cross_encoder_dir: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(tiny_cross_encoder_dir), device="cpu")


def post(cluster: Cluster, path: str, **body) -> httpx.Response:
    return httpx.post(f"{cluster.gateway_url}{path}", json=body, timeout=TIMEOUT_S)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, param: str, code: str | None = None) -> str:
    """OpenAI's error envelope, a 400 naming ``param``; returns the message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


# ---- a cross-encoder -------------------------------------------------------------------------


def test_rerank_matches_cross_encoder_predict(cluster: Cluster, cross_encoder) -> None:
    expected = cross_encoder.predict([(QUERY, doc) for doc in DOCUMENTS])
    body = ok(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=DOCUMENTS))
    assert body["model"] == RERANK and body["id"].startswith("rerank-")
    assert body["model_info"] == {"scoring": "cross-encoder"}
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    for result in results:
        assert abs(result["relevance_score"] - float(expected[result["index"]])) < 1e-5
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokens = cross_encoder.tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS)["input_ids"]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, tokens))


def test_rerank_top_n_objects_and_no_documents(cluster: Cluster) -> None:
    full = ok(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=DOCUMENTS))
    objects = [{"text": doc, "id": i} for i, doc in enumerate(DOCUMENTS)]
    top = ok(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=objects, top_n=3,
                  return_documents=False))
    assert [r["index"] for r in top["results"]] == [r["index"] for r in full["results"][:3]]
    assert all("document" not in r for r in top["results"])
    # top_n past the documents (and 0, vLLM's "all") gives them all; vLLM's and Jina's paths.
    for path, top_n in (("/rerank", 50), ("/v2/rerank", 0)):
        again = ok(post(cluster, path, model=RERANK, query=QUERY, documents=DOCUMENTS, top_n=top_n))
        assert [r["index"] for r in again["results"]] == [r["index"] for r in full["results"]]


def test_score_shapes_match_cross_encoder_predict(cluster: Cluster, cross_encoder) -> None:
    firsts = sentences(4, seed=8)
    one_to_many = ok(post(cluster, "/v1/score", model=RERANK, text_1=QUERY, text_2=DOCUMENTS[:5]))
    assert one_to_many["object"] == "list" and one_to_many["id"].startswith("score-")
    assert [d["index"] for d in one_to_many["data"]] == list(range(5))
    assert {d["object"] for d in one_to_many["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]],
                               cross_encoder.predict([(QUERY, d) for d in DOCUMENTS[:5]]), atol=1e-5)
    pairwise = ok(post(cluster, "/score", model=RERANK, text_1=firsts, text_2=DOCUMENTS[:4]))
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               cross_encoder.predict(list(zip(firsts, DOCUMENTS[:4]))), atol=1e-5)
    single = ok(post(cluster, "/v1/score", model=RERANK, text_1=[firsts[0]], text_2=DOCUMENTS[0]))
    assert abs(single["data"][0]["score"] - pairwise["data"][0]["score"]) < 1e-6
    message = refused(post(cluster, "/v1/score", model=RERANK, text_1=firsts, text_2=DOCUMENTS[:3]),
                      "text_2")
    assert "same length" in message


def test_pairs_are_batched_across_requests(cluster: Cluster, cross_encoder_llm) -> None:
    queries = sentences(16, seed=9, max_words=8)
    alone = [ok(post(cluster, "/v1/score", model=RERANK, text_1=q, text_2=DOCUMENTS[:2]))
             for q in queries[:4]]
    before = cross_encoder_llm._batcher.max_batch_inputs
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda q: ok(post(cluster, "/v1/score", model=RERANK, text_1=q,
                                                   text_2=DOCUMENTS[:2])), queries))
    for one, many in zip(alone, together):
        np.testing.assert_allclose([d["score"] for d in one["data"]],
                                   [d["score"] for d in many["data"]], atol=1e-6)
    # Some batch held pairs of more than one request (2 pairs each).
    assert max(before, cross_encoder_llm._batcher.max_batch_inputs) > 2


def test_the_worker_announces_and_serves_scores(cluster: Cluster) -> None:
    worker = cluster.worker_urls[RERANK]
    details = httpx.post(f"{worker}/model_details", json={"model": RERANK}, timeout=TIMEOUT_S).json()
    assert details["tasks"] == ["score"]
    answer = httpx.post(f"{worker}/worker_score", json={"model": RERANK, "text_1": ["a", "b"],
                                                          "text_2": ["c", "d"]},
                        timeout=TIMEOUT_S).json()
    assert answer["scoring"] == "cross-encoder" and len(answer["scores"]) == 2
    # FastChat's embeddings route, as a stock gateway would call it: refused, saying why.
    embeddings = httpx.post(f"{worker}/worker_get_embeddings", json={"model": RERANK, "input": ["a"]},
                            timeout=TIMEOUT_S).json()
    assert embeddings["error_code"] and "cross-encoder" in embeddings["text"]
    models = {m["id"]: m for m in httpx.get(f"{cluster.gateway_url}/v1/models",
                                             timeout=TIMEOUT_S).json()["data"]}
    assert models[RERANK]["tasks"] == ["score"] and models[EMBED]["tasks"] == ["embed"]


# ---- an embedding model: cosine ---------------------------------------------------------------


def test_an_embedding_model_ranks_by_cosine(cluster: Cluster, embedding_model_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedding_model_dir), device="cpu")
    vectors = reference.encode([QUERY] + DOCUMENTS, convert_to_numpy=True)
    expected = vectors[1:] @ vectors[0] / np.linalg.norm(vectors[1:], axis=1) / np.linalg.norm(vectors[0])
    body = ok(post(cluster, "/v1/rerank", model=EMBED, query=QUERY, documents=DOCUMENTS, top_n=5))
    assert body["model_info"] == {"scoring": "cosine"}
    assert [r["index"] for r in body["results"]] == list(np.argsort(-expected, kind="stable")[:5])
    for result in body["results"]:
        assert abs(result["relevance_score"] - float(expected[result["index"]])) < 1e-4
    score = ok(post(cluster, "/v1/score", model=EMBED, text_1=QUERY, text_2=DOCUMENTS[:3]))
    assert score["model_info"] == {"scoring": "cosine"}
    np.testing.assert_allclose([d["score"] for d in score["data"]], expected[:3], atol=1e-4)


# ---- refusals ---------------------------------------------------------------------------------


def test_bad_requests_are_400s_naming_the_field(cluster: Cluster) -> None:
    too_many = ["doc"] * (MAX_SCORE_PAIRS + 1)
    refused(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=too_many), "documents")
    refused(post(cluster, "/v1/score", model=RERANK, text_1=QUERY, text_2=too_many), "text_2")
    refused(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=[]), "documents")
    refused(post(cluster, "/v1/score", model=RERANK, text_1=[], text_2="x"), "text_1")
    refused(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=["a"], top_n=-1),
            "top_n")
    refused(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=["a"],
                 rank_fields=["title"]), "rank_fields")
    refused(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=[{"title": "a"}]),
            "documents[0]")
    long_document = " ".join(["river"] * (TINY_CROSS_ENCODER_POSITIONS + 5))
    message = refused(post(cluster, "/v1/rerank", model=RERANK, query=QUERY,
                           documents=["short", long_document]), "documents", "context_length_exceeded")
    assert "'documents'" in message
    cut = ok(post(cluster, "/v1/rerank", model=RERANK, query=QUERY, documents=["short", long_document],
                  truncate_prompt_tokens=-1))
    assert len(cut["results"]) == 2
    # An embedding model names the side that is too long (all-MiniLM-L6-v2 reads 256 tokens).
    refused(post(cluster, "/v1/rerank", model=EMBED, query=" ".join(["sea"] * 300),
                 documents=["a"]), "query", "context_length_exceeded")


def test_a_generation_model_serves_no_scores(cluster: Cluster) -> None:
    for path, body in (("/v1/rerank", {"query": QUERY, "documents": ["a"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})):
        assert "generation model" in refused(post(cluster, path, model=CHAT, **body), "model")
    # And the reranker serves neither chat nor embeddings.
    chat = post(cluster, "/v1/chat/completions", model=RERANK,
                messages=[{"role": "user", "content": "hi"}])
    assert "cross-encoder" in refused(chat, "model")
    assert "cross-encoder" in refused(post(cluster, "/v1/embeddings", model=RERANK, input="hi"),
                                      "model")


# ---- real processes: the worker's command line ------------------------------------------------


def test_a_cross_encoder_worker_process_serves_rerank(tiny_cross_encoder_dir: Path, cross_encoder,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.integration.test_fastchat_interop import list_models, services_in
    from tests.processes import free_port

    controller_url, worker_port, gateway_url = (f"http://127.0.0.1:{free_port()}", free_port(),
                                                f"http://127.0.0.1:{free_port()}")
    with services_in(tmp_path_factory.mktemp("rerank-processes")) as services:
        services.start("controller", "-m", "llmplatform.controller",
                       "--port", controller_url.rsplit(":", 1)[1])
        services.start("gateway", "-m", "llmplatform.openai_api", "--port",
                       gateway_url.rsplit(":", 1)[1], "--controller-address", controller_url)
        services.wait_until("the controller up", lambda: httpx.get(
            f"{controller_url}/health", timeout=5).status_code == 200)
        services.start("worker", "-m", "llmplatform.model_worker", "--model-path",
                       str(tiny_cross_encoder_dir), "--model-names", RERANK, "--task", "score",
                       "--port", str(worker_port), "--controller-address", controller_url,
                       "--device", "cpu")
        services.wait_until("the worker registered", lambda: list_models(controller_url) == [RERANK])
        services.wait_until("the gateway up", lambda: httpx.get(
            f"{gateway_url}/health", timeout=5).status_code == 200)
        response = httpx.post(f"{gateway_url}/v1/rerank", timeout=TIMEOUT_S, json={
            "model": RERANK, "query": QUERY, "documents": DOCUMENTS[:4], "top_n": 2})
    body = ok(response)
    expected = cross_encoder.predict([(QUERY, doc) for doc in DOCUMENTS[:4]])
    assert [r["index"] for r in body["results"]] == list(np.argsort(-expected, kind="stable")[:2])
    for result in body["results"]:
        assert abs(result["relevance_score"] - float(expected[result["index"]])) < 1e-5


def test_scores_count_against_a_keys_tokens_per_minute(tiny_cross_encoder_dir: Path) -> None:
    from llmplatform.openai_api.settings import TenantLimits

    key = "sk-rerank-test"
    limits = TenantLimits(max_concurrent_requests=None, max_tokens_per_minute=60)
    with running_cluster(api_keys=(key,), tenant_limits=limits) as cluster:
        cluster.add_worker(build_backend(BackendConfig(model_path=str(tiny_cross_encoder_dir),
                                                       model_names=(RERANK,), device="cpu")))
        headers = {"Authorization": f"Bearer {key}"}
        for path in ("/v1/rerank", "/v2/rerank"):  # no key: no scores, on vLLM's paths too
            assert httpx.post(f"{cluster.gateway_url}{path}", timeout=TIMEOUT_S, json={
                "model": RERANK, "query": QUERY, "documents": ["a"]}).status_code == 401
        first = httpx.post(f"{cluster.gateway_url}/v1/rerank", headers=headers, timeout=TIMEOUT_S,
                           json={"model": RERANK, "query": QUERY, "documents": DOCUMENTS})
        assert ok(first)["usage"]["total_tokens"] > 60  # charged: the bucket is below zero now
        second = httpx.post(f"{cluster.gateway_url}/score", headers=headers, timeout=TIMEOUT_S,
                            json={"model": RERANK, "text_1": "a", "text_2": "b"})
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1


def test_a_stock_fastchat_worker_serves_no_scores() -> None:
    """A stock worker (tests/fake_worker.py: FastChat's /model_details, no ``tasks``) has no
    /worker_score: a 400 naming ``model``, before anything is sent to it."""
    from tests.security.test_tenant_limits import FAKE_MODEL, tenant_cluster

    with tenant_cluster() as cluster:
        for path, body in (("/v1/rerank", {"query": QUERY, "documents": ["a"]}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"})):
            response = httpx.post(f"{cluster.gateway}{path}", json={"model": FAKE_MODEL, **body},
                                  timeout=TIMEOUT_S)
            assert "stock FastChat worker" in refused(response, "model")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"query": 3, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": "a"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": 1}, "return_documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": -2},
     "truncate_prompt_tokens"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
    ("/v1/score", {"text_1": None, "text_2": "b"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
])
def test_bad_fields_are_400s_naming_them(cluster: Cluster, path: str, body: dict, param: str) -> None:
    refused(post(cluster, path, model=RERANK, **body), param)
