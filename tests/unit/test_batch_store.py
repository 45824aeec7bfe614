"""The files and batches database: exactly-once line results, status moves only over the status
read, per-owner visibility and pagination, the sweep of orphaned contents; and the input check."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from llmplatform.openai_api.batch_input import check_input
from llmplatform.openai_api.batch_store import (
    BatchNotFoundError, BatchStore, FileNotFoundInStoreError, LineResult, PendingLine,
)
from llmplatform.protocol.batches import Batch, FileObject


def run(coro):
    return asyncio.run(coro)


def batch(batch_id: str = "batch_1", status: str = "validating") -> Batch:
    return Batch(id=batch_id, endpoint="/v1/completions", input_file_id="file-1",
                 completion_window="24h", status=status, created_at=1, expires_at=2)


def test_a_line_result_is_recorded_and_counted_once(tmp_path: Path) -> None:
    async def go() -> None:
        store = BatchStore(str(tmp_path / "b.sqlite3"), str(tmp_path / "files"))
        await store.add_batch("key:a", batch())
        started = batch(status="in_progress")
        started.request_counts.total = 2
        assert await store.start_lines(started, [PendingLine(1, "a", "{}"), PendingLine(3, "b", "{}")])
        assert not await store.start_lines(started, [])  # no longer validating
        result = LineResult("completed", '{"x": 1}', input_tokens=5, output_tokens=7)
        assert await store.finish_line("batch_1", 1, result)
        assert not await store.finish_line("batch_1", 1, LineResult("failed", "{}"))
        assert [p.line for p in await store.pending_lines("batch_1", 0, 10)] == [3]
        got = await store.get_batch("key:a", "batch_1")
        assert (got.request_counts.total, got.request_counts.completed, got.request_counts.failed) == (2, 1, 0)
        assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (5, 7, 12)
        assert [row[1] for row in await store.results_page("batch_1", "completed", 0, 10)] == ["a"]
        assert [row[1] for row in await store.results_page("batch_1", None, 0, 10)] == ["b"]
        await store.aclose()

    run(go())


def test_a_status_move_is_made_only_over_the_status_read(tmp_path: Path) -> None:
    async def go() -> None:
        store = BatchStore(str(tmp_path / "b.sqlite3"), str(tmp_path / "files"))
        await store.add_batch("key:a", batch(status="in_progress"))
        assert await store.save_batch(batch(status="cancelling"), only_if=("in_progress",))
        assert not await store.save_batch(batch(status="finalizing"), only_if=("in_progress",))
        done = batch(status="cancelled")
        output = FileObject(id="file-out", bytes=1, created_at=1, filename="o", purpose="batch_output")
        assert not await store.finish_batch("key:a", done, [output], was="in_progress")
        with pytest.raises(FileNotFoundInStoreError):
            await store.get_file("key:a", "file-out")  # the losing move registered nothing
        assert await store.finish_batch("key:a", done, [output], was="cancelling")
        assert (await store.get_file("key:a", "file-out")).purpose == "batch_output"
        assert (await store.get_batch("key:a", "batch_1")).status == "cancelled"
        assert await store.active_batches() == []
        await store.aclose()

    run(go())


def test_objects_are_their_owners_only_and_lists_page(tmp_path: Path) -> None:
    async def go() -> None:
        store = BatchStore(str(tmp_path / "b.sqlite3"), str(tmp_path / "files"))
        for n in range(3):
            await store.add_file("key:a", FileObject(id=f"file-{n}", bytes=0, created_at=n,
                                                     filename="f", purpose="batch"))
            await store.add_batch("key:a", batch(f"batch_{n}"))
        with pytest.raises(FileNotFoundInStoreError):
            await store.get_file("key:b", "file-0")
        with pytest.raises(BatchNotFoundError):
            await store.get_batch("key:b", "batch_0")
        with pytest.raises(FileNotFoundInStoreError):
            await store.delete_file("key:b", "file-0")
        assert await store.list_files("key:b", purpose=None, after=None, limit=10, newest_first=True) == ([], False)
        files, more = await store.list_files("key:a", purpose="batch", after=None, limit=2, newest_first=True)
        assert [f.id for f in files] == ["file-2", "file-1"] and more
        files, more = await store.list_files("key:a", purpose=None, after="file-0", limit=2, newest_first=False)
        assert [f.id for f in files] == ["file-1", "file-2"] and not more
        batches, more = await store.list_batches("key:a", after="batch_2", limit=5)
        assert [b.id for b in batches] == ["batch_1", "batch_0"] and not more
        await store.aclose()

    run(go())


def test_the_sweep_removes_contents_without_a_row(tmp_path: Path) -> None:
    async def go() -> None:
        store = BatchStore(str(tmp_path / "b.sqlite3"), str(tmp_path / "files"))
        assert not store.exists()
        store.file_path("file-kept").write_bytes(b"k")
        await store.add_file("key:a", FileObject(id="file-kept", bytes=1, created_at=1,
                                                 filename="f", purpose="batch"))
        store.file_path("file-orphan").write_bytes(b"o")
        store.file_path("file-x.part").write_bytes(b"p")
        assert store.exists()
        assert sorted(await store.sweep()) == ["file-orphan", "file-x.part"]
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == ["file-kept"]
        await store.delete_file("key:a", "file-kept")
        assert list((tmp_path / "files").iterdir()) == []
        await store.aclose()

    run(go())


def test_the_input_check_reports_each_bad_line_and_keeps_the_good_ones(tmp_path: Path) -> None:
    def request(custom_id: str, model: str = "m", url: str = "/v1/completions") -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                           "body": {"model": model, "prompt": "x"}})

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([request("a"), "", request("b"), "[1]", request("c", url="/v1/embeddings"),
                               json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions"})]))
    checked = check_input(path, "/v1/completions", max_requests=10)
    assert [p.custom_id for p in checked.lines] == ["a", "b"] and checked.model == "m"
    assert [(e.code, e.line, e.param) for e in checked.errors] == [
        ("invalid_json_line", 4, None), ("url_mismatch", 5, "url"), ("invalid_request", 6, "body")]
    too_many = check_input(path, "/v1/completions", max_requests=1)
    assert too_many.errors[-1].code == "too_many_tasks"


def test_settings_refuse_bad_batch_limits_and_other_databases() -> None:
    from llmplatform.openai_api.settings import GatewaySettings

    for bad in (dict(batch_concurrency=0), dict(max_upload_bytes=0), dict(batch_max_requests=-1),
                dict(batch_expiry=0), dict(batches_store="postgresql://db/x")):
        with pytest.raises(ValueError):
            GatewaySettings(**bad)
