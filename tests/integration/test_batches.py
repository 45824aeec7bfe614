"""OpenAI's Files and Batch APIs end to end: a real controller, a paged worker serving the tiny
random Llama, an embedding worker (the packaged all-MiniLM-L6-v2) and a gateway with API keys,
files and batches on disk, driven with the official openai client.

Each batch's lines run through the gateway's own endpoints at the batch priority; results are
read back from the output and error files as a client reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.protocol.worker import BATCH_PRIORITY
from tests.integration.cluster import Cluster, paged_tiny_llm, running_cluster
from tests.polling import wait_until

KEY_A, KEY_B = "key-a", "key-b"
CHAT, EMBED = "tiny", "minilm"
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_UPLOAD = 64 * 1024


@pytest.fixture(scope="module")
def paged(tiny_model_dir: Path):
    return paged_tiny_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def cluster(paged, embedding_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("batches")
    with running_cluster(api_keys=(KEY_A, KEY_B), files_dir=str(folder / "files"),
                         batches_store=str(folder / "batches.sqlite3"),
                         max_upload_bytes=MAX_UPLOAD, batch_concurrency=2) as cluster:
        cluster.add_worker(paged)
        cluster.add_worker(build_backend(BackendConfig(model_path=str(embedding_model_dir),
                                                       model_names=(EMBED,), device="cpu")))
        yield cluster


def client_for(cluster: Cluster, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return client_for(cluster)


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_line(custom_id: str, text: str = "Tell me a story.", **extra: Any) -> dict[str, Any]:
    return line(custom_id, "/v1/chat/completions", model=CHAT, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": text}], **extra)


def upload(client: openai.OpenAI, lines: list[Any], purpose: str = "batch"):
    text = "\n".join(entry if isinstance(entry, str) else json.dumps(entry) for entry in lines)
    return client.files.create(file=("input.jsonl", text.encode()), purpose=purpose)


def run_batch(client: openai.OpenAI, lines: list[Any], endpoint: str = "/v1/chat/completions",
              **extra: Any):
    file = upload(client, lines)
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint,
                                  completion_window="24h", **extra)
    assert batch.status == "validating" and batch.input_file_id == file.id
    return wait_final(client, batch.id)


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0):
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in FINAL and b,
                      timeout_s=timeout_s, interval_s=0.1, what=f"batch {batch_id} to end")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def test_a_chat_batch_runs_every_line_and_returns_outputs_and_errors(client):
    lines = [chat_line(f"c{i}", f"Tell me story number {i}.") for i in range(3)]
    lines.append(chat_line("bad", max_completion_tokens=-1))  # the endpoint refuses it: a 400
    batch = run_batch(client, lines, metadata={"job": "nightly"})
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.model == CHAT and batch.metadata == {"job": "nightly"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.expires_at
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0

    output = read_lines(client, batch.output_file_id)
    assert [entry["custom_id"] for entry in output] == ["c0", "c1", "c2"]
    for entry in output:
        assert entry["id"].startswith("batch_req_") and entry["error"] is None
        response = entry["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["usage"]["completion_tokens"] >= 1
    errors = read_lines(client, batch.error_file_id)
    assert [entry["custom_id"] for entry in errors] == ["bad"]
    assert errors[0]["response"]["status_code"] == 400 and errors[0]["error"] is None
    assert errors[0]["response"]["body"]["error"]["param"] == "max_completion_tokens"

    listed = client.files.list(purpose="batch_output").data
    assert {batch.output_file_id, batch.error_file_id} <= {f.id for f in listed}
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
