"""Embeddings across stock FastChat (fschat 0.2.36), both ways, with real processes:

1. our embedding worker (all-MiniLM-L6-v2) under a stock FastChat controller and OpenAI server:
   the official client's ``embeddings.create`` through FastChat's server gets our vectors;
2. a stock FastChat ``model_worker`` (the tiny Llama: FastChat embeds with a decoder's mean
   pooled last hidden states) under our controller and gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.test_fastchat_interop import (REQUEST_TIMEOUT_S, WRAPPER, list_models,
                                                     openai_client, services_in)
from tests.processes import free_port

TEXTS = ["hello world", "", "a longer sentence about the sea and the mountains"]


@pytest.fixture(scope="module")
def fastchat_api_url(embedding_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[str]:
    controller_port, worker_port, api_port = free_port(), free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    api_url = f"http://127.0.0.1:{api_port}"
    with services_in(tmp_path_factory.mktemp("fastchat-embeddings")) as services:
        services.start("fastchat-controller", "-m", "fastchat.serve.controller",
                       "--host", "127.0.0.1", "--port", str(controller_port))
        services.start("our-worker", "-m", "llmplatform.model_worker",
                       "--model-path", str(embedding_model_dir), "--model-names", "minilm",
                       "--port", str(worker_port), "--controller-address", controller_url,
                       "--device", "cpu")
        services.start("fastchat-openai-server", str(WRAPPER), "fastchat.serve.openai_api_server",
                       "--host", "127.0.0.1", "--port", str(api_port),
                       "--controller-address", controller_url)
        services.wait_until("our worker registered with FastChat's controller",
                            lambda: list_models(controller_url) == ["minilm"])
        services.wait_until("FastChat's OpenAI server up",
                            lambda: httpx.get(f"{api_url}/v1/models", timeout=5).status_code == 200)
        yield api_url


def test_fastchat_gateway_serves_our_embeddings(fastchat_api_url: str,
                                                embedding_model_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    client = openai_client(fastchat_api_url)
    expected = SentenceTransformer(str(embedding_model_dir), device="cpu").encode(TEXTS)
    # The client asks for base64 unless told (and decodes it); FastChat passes it on to the worker.
    for encoding_format in ("float", openai.NOT_GIVEN):
        response = client.embeddings.create(model="minilm", input=TEXTS,
                                            encoding_format=encoding_format)
        got = np.array([d.embedding for d in response.data], dtype=np.float32)
        assert [d.index for d in response.data] == [0, 1, 2]
        cosines = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosines.min() >= 0.9999
        assert response.usage.prompt_tokens == 4 + 2 + 11


@pytest.fixture(scope="module")
def our_gateway_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[str, str]]:
    controller_port, worker_port, gateway_port = free_port(), free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    worker_url = f"http://127.0.0.1:{worker_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    with services_in(tmp_path_factory.mktemp("stock-worker-embeddings")) as services:
        services.start("our-controller", "-m", "llmplatform.controller", "--port", str(controller_port))
        services.start("our-gateway", "-m", "llmplatform.openai_api", "--port", str(gateway_port),
                       "--controller-address", controller_url)
        services.wait_until("our controller up", lambda: httpx.get(
            f"{controller_url}/health", timeout=5).status_code == 200)
        services.start("fastchat-worker", str(WRAPPER), "fastchat.serve.model_worker",
                       "--host", "127.0.0.1", "--port", str(worker_port),
                       "--worker-address", worker_url, "--controller-address", controller_url,
                       "--model-path", str(tiny_model_dir), "--model-names", "tiny-fc",
                       "--device", "cpu")
        services.wait_until("the stock worker registered with our controller",
                            lambda: list_models(controller_url) == ["tiny-fc"])
        services.wait_until("our gateway up", lambda: httpx.get(
            f"{gateway_url}/health", timeout=5).status_code == 200)
        yield gateway_url, worker_url


def test_our_gateway_serves_a_stock_workers_embeddings(our_gateway_url: tuple[str, str]) -> None:
    gateway_url, worker_url = our_gateway_url
    client = openai_client(gateway_url)
    texts = [f"sentence number {i} about the sea" for i in range(6)]  # two calls of FastChat's 4
    response = client.embeddings.create(model="tiny-fc", input=texts)
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(6)) and got.shape == (6, 64)
    # The stock worker's own answer, asked directly, is what the gateway passed on, in order.
    direct = httpx.post(f"{worker_url}/worker_get_embeddings",
                        json={"model": "tiny-fc", "input": texts}, timeout=REQUEST_TIMEOUT_S).json()
    np.testing.assert_allclose(got, np.array(direct["embedding"], dtype=np.float32), atol=1e-5)
    assert response.usage.prompt_tokens == direct["token_num"]
    # What a stock worker cannot do is a 400 naming the field.
    for extra in ({"dimensions": 8}, {"truncate_prompt_tokens": 4}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="tiny-fc", input="x", **(
                {"dimensions": 8} if "dimensions" in extra else {"extra_body": extra}))
        assert refused.value.body["param"] == next(iter(extra))
