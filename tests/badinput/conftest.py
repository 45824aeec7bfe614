"""Hypothesis keeps caches in `.hypothesis/` under the working directory; keep them out of the
repository (and the example database off: the property tests are derandomized).

`two_backends`: the tiny model on the paged and the hf backend behind real workers, a controller
and a gateway, shared by the tests that need real token ids checked against a real vocabulary.

`cluster` and `http`: a real controller and gateway with the fake worker (tests/fake_worker.py),
one per module, for the gateway's refusals (test_gateway_bad_body.py, test_gateway_bad_fields.py);
modules that need other servers override `cluster`. `still_serving` checks after each test that a
good request is still answered; `post_refused` that a refused one never reached the worker.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from tests.fake_worker import MODEL, FakeCluster, assert_envelope, fake_cluster, reply

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llmplatform-hypothesis")


# ---- a real cluster with the tiny model on both backends ------------------------------------------

BACKENDS = ("paged", "hf")
TINY_VOCAB_SIZE = 49152  # the tiny model's logits: SmolLM2's tokenizer length
TINY_CONTEXT_LENGTH = 512


def model_name(backend: str) -> str:
    return f"tiny-{backend}"


@dataclass
class TwoBackendCluster:
    gateway_url: str
    worker_urls: dict[str, str]
    """backend -> the URL of the worker serving the tiny model on it."""
    tokenizer: Any

    def assert_all_serving(self) -> None:
        """Every worker's /health is 200 and each still generates, straight and via the gateway."""
        for backend, url in self.worker_urls.items():
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 200, (backend, health.text)
            last = httpx.post(f"{url}/worker_generate", timeout=60, json={
                "model": model_name(backend), "prompt": "The sea is", "max_new_tokens": 2,
                "temperature": 0, "echo": False})
            body = last.json()
            assert last.status_code == 200 and body["error_code"] == 0, (backend, body)
            assert body["usage"]["completion_tokens"] >= 1
            reply = httpx.post(f"{self.gateway_url}/v1/completions", timeout=60, json={
                "model": model_name(backend), "prompt": "The sea is", "max_tokens": 2})
            assert reply.status_code == 200, (backend, reply.text)


@pytest.fixture(scope="session")
def two_backends(tiny_model_dir: Any) -> Iterator[TwoBackendCluster]:
    """The tiny model (real tokenizer, random weights) on the paged and the hf backend, each
    behind its own real worker, with a real controller and gateway, all on 127.0.0.1."""
    from transformers import AutoTokenizer

    from llmplatform.llm.build import BackendConfig, build_backend
    from tests.integration.cluster import running_cluster

    with running_cluster() as cluster:
        urls = {}
        for backend in BACKENDS:
            extra = {"kv_cache_memory": "64MiB"} if backend == "paged" else {"max_concurrency": 2}
            llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=(model_name(backend),),
                                          backend=backend, device="cpu", dtype="float32", **extra))
            assert llm.facts.vocab_size == TINY_VOCAB_SIZE
            urls[backend] = cluster.add_worker(llm)
        yield TwoBackendCluster(cluster.gateway_url, urls, AutoTokenizer.from_pretrained(tiny_model_dir))


# ---- a fake worker behind the real gateway ----------------------------------------------------------

USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    with fake_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def http(cluster: FakeCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.gateway, timeout=30) as client:
        yield client


@pytest.fixture
def still_serving(http: httpx.Client) -> Iterator[None]:
    """After every bad request, a good one is still answered."""
    yield
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reply(2)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "once upon", **fields}


def post_refused(cluster: FakeCluster, http: httpx.Client, path: str, status: int, **kwargs: Any) -> dict[str, Any]:
    """POST that must be refused with `status` before any worker generates."""
    before = cluster.worker.received()
    error = assert_envelope(http.post(path, **kwargs), status)
    assert cluster.worker.received() == before, "a refused request reached the worker"
    return error
