"""OpenAI's Files and Batch APIs end to end: a real controller, a paged worker serving the tiny
random Llama, an embedding worker (the packaged all-MiniLM-L6-v2) and a gateway with API keys,
files and batches on disk, driven with the official openai client.

Each batch's lines run through the gateway's own endpoints at the batch priority; results are
read back from the output and error files as a client reads them.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.tenants import key_id
from llmplatform.protocol.worker import BACKGROUND_PRIORITY
from tests.integration.cluster import Cluster, paged_tiny_llm, running_cluster
from llmplatform.utils.server import serve_in_thread
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
                         max_upload_bytes=MAX_UPLOAD, batch_concurrency=2,
                         # The Host check applies to the runner's own requests too.
                         allowed_hosts=frozenset({"127.0.0.1"})) as cluster:
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
    body = dict(model=CHAT, max_tokens=4, temperature=0, messages=[{"role": "user", "content": text}])
    return line(custom_id, "/v1/chat/completions", **{**body, **extra})


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


def key_metric(cluster: Cluster, name: str, key: str) -> float:
    text = httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"llmplatform:{name}_total" and sample.labels.get("key_id") == key_id(key):
                return sample.value
    return 0.0


def test_a_chat_batch_runs_every_line_and_returns_outputs_and_errors(client, cluster):
    lines = [chat_line(f"c{i}", f"Tell me story number {i}.") for i in range(3)]
    lines.append(chat_line("bad", max_completion_tokens=-1))  # the endpoint refuses it: a 400
    requests_before = key_metric(cluster, "gateway_key_requests", KEY_A)
    tokens_before = key_metric(cluster, "gateway_key_completion_tokens", KEY_A)
    others_before = key_metric(cluster, "gateway_key_requests", KEY_B)
    batch = run_batch(client, lines, metadata={"job": "nightly"})
    # Every line was admitted, and its tokens counted, as the batch owner's requests.
    assert key_metric(cluster, "gateway_key_requests", KEY_A) - requests_before == 4
    assert key_metric(cluster, "gateway_key_completion_tokens", KEY_A) - tokens_before == batch.usage.output_tokens
    assert key_metric(cluster, "gateway_key_requests", KEY_B) == others_before
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


def test_completions_embeddings_and_responses_batches(client):
    completions = run_batch(client, [
        line(f"p{i}", "/v1/completions", model=CHAT, prompt=f"Once upon a time {i}", max_tokens=3)
        for i in range(2)], endpoint="/v1/completions")
    assert completions.status == "completed" and completions.request_counts.completed == 2
    for entry in read_lines(client, completions.output_file_id):
        assert entry["response"]["body"]["object"] == "text_completion"
        assert entry["response"]["body"]["choices"][0]["text"] is not None

    embeddings = run_batch(client, [line(f"e{i}", "/v1/embeddings", model=EMBED, input=[f"text {i}", "more"])
                                    for i in range(2)], endpoint="/v1/embeddings")
    assert embeddings.status == "completed" and embeddings.request_counts.completed == 2
    for entry in read_lines(client, embeddings.output_file_id):
        vectors = entry["response"]["body"]["data"]
        assert len(vectors) == 2 and len(vectors[0]["embedding"]) == 384

    responses = run_batch(client, [line(f"r{i}", "/v1/responses", model=CHAT, input=f"Hello {i}",
                                        max_output_tokens=3) for i in range(2)],
                          endpoint="/v1/responses")
    assert responses.status == "completed" and responses.request_counts.completed == 2
    for entry in read_lines(client, responses.output_file_id):
        body = entry["response"]["body"]
        assert body["object"] == "response" and body["id"].startswith("resp_")
        assert client.responses.retrieve(body["id"]).id == body["id"]  # stored for the owner


def test_a_bad_input_file_fails_the_batch_with_one_error_per_line(client):
    batch = run_batch(client, [
        chat_line("a"),
        "{not json",
        line("b", "/v1/completions", model=CHAT, prompt="x"),
        chat_line("a"),
        {**chat_line("c"), "method": "GET"},
        line("d", "/v1/chat/completions", model="another", messages=[]),
    ])
    assert batch.status == "failed" and batch.failed_at
    codes = [(e.code, e.line, e.param) for e in batch.errors.data]
    assert codes == [("invalid_json_line", 2, None), ("url_mismatch", 3, "url"),
                     ("duplicate_custom_id", 4, "custom_id"), ("invalid_request", 5, "method"),
                     ("model_mismatch", 6, "body.model")]
    assert batch.output_file_id is None and batch.error_file_id is None

    empty = run_batch(client, ["", "  "])
    assert empty.status == "failed" and [e.code for e in empty.errors.data] == ["empty_file"]


def test_create_refuses_what_openai_refuses_with_a_400_naming_the_field(client):
    file = upload(client, [chat_line("a")])
    other = upload(client, [chat_line("a")], purpose="user_data")
    cases = [
        (dict(input_file_id=file.id, endpoint="/v1/moderations", completion_window="24h"), "endpoint"),
        (dict(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1h"),
         "completion_window"),
        (dict(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h"),
         "input_file_id"),
        (dict(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"),
         "input_file_id"),
        (dict(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
              metadata={"k" * 65: "v"}), "metadata"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.batches.create(**arguments)
        assert info.value.body["param"] == param, info.value.body


def test_cancel_aborts_the_lines_in_flight_and_keeps_what_finished(client, paged):
    lines = [chat_line(f"l{i}", max_tokens=400, ignore_eos=True) for i in range(8)]
    file = upload(client, lines)
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_until(lambda: paged.load().num_running + paged.load().num_waiting > 0,
               what="a batch line on the worker")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait_final(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed + batch.request_counts.failed < 8
    unrun = [e for e in read_lines(client, batch.error_file_id) if e["error"] is not None]
    assert unrun and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in unrun)
    # Aborted down to the engine at once (nothing left of 400-token lines).
    wait_until(lambda: paged.load().num_running + paged.load().num_waiting == 0, timeout_s=10,
               what="the worker to drop the cancelled lines", context=paged.load)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(run_batch(client, [chat_line("x")]).id)  # completed: too late
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: answered as it is


def test_lists_are_paginated_newest_first(client):
    ids = [run_batch(client, ["{bad"]).id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == ids[0]
    files = [upload(client, [chat_line(str(i))], purpose="user_data").id for i in range(3)]
    first = client.files.list(purpose="user_data", limit=2)
    assert [f.id for f in first.data] == files[::-1][:2] and first.has_more
    ascending = client.files.list(purpose="user_data", order="asc")
    assert [f.id for f in ascending.data][-3:] == files


def test_an_upload_over_the_limit_is_a_413_and_leaves_nothing(client, cluster):
    before = {f.id for f in client.files.list().data}
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", b"x" * (MAX_UPLOAD + 1)), purpose="batch")
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused while it is read
        yield (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
               b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.jsonl\"\r\n\r\n")
        for _ in range(64):
            yield b"y" * 4096
        yield b"\r\n--b--\r\n"

    response = httpx.post(f"{cluster.gateway_url}/v1/files", content=chunks(), timeout=30,
                          headers={"authorization": f"Bearer {KEY_A}",
                                   "content-type": "multipart/form-data; boundary=b"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert {f.id for f in client.files.list().data} == before
    small = client.files.create(file=("ok.jsonl", b"y" * MAX_UPLOAD), purpose="user_data")
    assert small.bytes == MAX_UPLOAD and client.files.content(small.id).content == b"y" * MAX_UPLOAD
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("a.txt", b"a"), purpose="nonsense")
    assert refused.value.body["param"] == "purpose"


def test_files_and_batches_are_visible_to_their_key_only(client, cluster):
    other = client_for(cluster, KEY_B)
    file = upload(client, [chat_line("a")])
    batch = run_batch(client, [chat_line("a")])
    for call in (lambda: other.files.retrieve(file.id), lambda: other.files.content(file.id),
                 lambda: other.files.delete(file.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.files.content(batch.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError):  # nor can it run another key's file
        other.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert other.files.list().data == [] and other.batches.list().data == []
    deleted = client.files.delete(file.id)
    assert deleted.deleted and deleted.id == file.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_an_interactive_priority_in_the_batch_band_is_a_400(client):
    for call in (lambda **kw: client.chat.completions.create(
                     model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=1, **kw),
                 lambda **kw: client.completions.create(model=CHAT, prompt="hi", max_tokens=1, **kw),
                 lambda **kw: client.responses.create(model=CHAT, input="hi", max_output_tokens=1, **kw)):
        with pytest.raises(openai.BadRequestError) as info:
            call(extra_body={"priority": BACKGROUND_PRIORITY})
        assert info.value.body["param"] == "priority"
        assert call(extra_body={"priority": BACKGROUND_PRIORITY - 1}) is not None


def test_batch_lines_reach_the_worker_in_the_batch_band(client, paged, monkeypatch):
    seen: list[int] = []
    generate = paged.generate

    def recording(request):
        seen.append(request.priority)
        return generate(request)

    monkeypatch.setattr(paged, "generate", recording)
    batch = run_batch(client, [chat_line("a"), chat_line("b", priority=7), chat_line("c", priority=-9)])
    assert batch.status == "completed"
    assert sorted(seen) == [BACKGROUND_PRIORITY, BACKGROUND_PRIORITY, BACKGROUND_PRIORITY + 7]
    seen.clear()
    client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    client.responses.create(model=CHAT, input="hi", max_output_tokens=1, extra_body={"priority": 3})
    assert seen == [0, 3]  # interactive requests keep their own


def finished_by_length(cluster: Cluster) -> float:
    """The worker's count of requests that ran to their max_tokens (aborted ones are `abort`)."""
    text = httpx.get(f"{cluster.worker_urls[CHAT]}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "llmplatform:request_success_total"
                    and sample.labels.get("finished_reason") == "length"):
                return sample.value
    return 0.0


def test_a_restarted_gateway_resumes_a_batch_and_runs_each_line_once(cluster, tmp_path: Path):
    settings = GatewaySettings(controller_address=cluster.controller_url, api_keys=(KEY_A,),
                               files_dir=str(tmp_path / "files"),
                               batches_store=str(tmp_path / "batches.sqlite3"), batch_concurrency=1)
    count = 8
    lines = [chat_line(f"r{i}", max_tokens=96, ignore_eos=True) for i in range(count)]
    before = finished_by_length(cluster)
    with serve_in_thread(create_gateway_app(settings)) as url:
        first = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=60)
        batch = first.batches.create(input_file_id=upload(first, lines).id,
                                     endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(lambda: first.batches.retrieve(batch.id).request_counts.completed >= 2,
                   timeout_s=120, interval_s=0.05, what="two lines finished")
    # Stopped mid-batch: its line in flight was aborted, the finished ones are in the database.
    with contextlib.closing(sqlite3.connect(tmp_path / "batches.sqlite3")) as db:
        status, done = db.execute("SELECT status, completed FROM batches").fetchone()
        unfinished = db.execute("SELECT count(*) FROM batch_lines WHERE outcome IS NULL").fetchone()[0]
    assert status == "in_progress" and 2 <= done < count and unfinished == count - done

    with serve_in_thread(create_gateway_app(settings)) as url:
        second = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=60)
        batch = wait_final(second, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == count
        output = read_lines(second, batch.output_file_id)
    assert [entry["custom_id"] for entry in output] == [f"r{i}" for i in range(count)]
    assert all(entry["response"]["body"]["usage"]["completion_tokens"] == 96 for entry in output)
    # Every line ran to its end on the worker exactly once: none finished twice.
    assert finished_by_length(cluster) - before == count


def test_a_batch_past_its_window_expires_with_its_unrun_lines_in_the_error_file(cluster, tmp_path: Path):
    settings = GatewaySettings(controller_address=cluster.controller_url, api_keys=(KEY_A,),
                               files_dir=str(tmp_path / "files"), batch_expiry=1.5,
                               batches_store=str(tmp_path / "batches.sqlite3"), batch_concurrency=1)
    lines = [chat_line(f"x{i}", max_tokens=300, ignore_eos=True) for i in range(6)]
    with serve_in_thread(create_gateway_app(settings)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=60)
        batch = client.batches.create(input_file_id=upload(client, lines).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        assert batch.expires_at - batch.created_at in (1, 2)
        batch = wait_final(client, batch.id)
        assert batch.status == "expired" and batch.expired_at
        errors = read_lines(client, batch.error_file_id)
        finished = read_lines(client, batch.output_file_id) if batch.output_file_id else []
    unrun = [e for e in errors if e["error"] is not None]
    assert unrun and all(e["error"]["code"] == "batch_expired" for e in unrun)
    assert sorted(e["custom_id"] for e in [*finished, *errors]) == sorted(f"x{i}" for i in range(6))
    assert batch.request_counts.completed == len(finished)
