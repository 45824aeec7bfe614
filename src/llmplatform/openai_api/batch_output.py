"""A batch's end: its output and error files, written from its lines, and its final status.

The output file holds the lines answered 2xx, the error file the others (their ``response``
carries the endpoint's error envelope) and, when the batch ends before every line ran
(cancelled, expired, failed), one line per unrun request with ``response: null`` and an
``error`` saying why (OpenAI's ``batch_expired``; ``batch_cancelled`` and ``batch_failed`` in
the same shape). Lines are in input order. Each file is written beside its final name and
renamed when whole; the batch's final object, the files' rows and the dropping of its lines
are then one transaction, made only if the batch's status is still what the finaliser read (a
file written for a move that lost is removed; one orphaned by a crash is swept at the next
start, and the finalisation runs again).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path

from llmplatform.openai_api.batch_store import BatchStore
from llmplatform.protocol.batches import (
    BATCH_OUTPUT_PURPOSE, Batch, BatchLineError, BatchOutputLine, FileObject,
)

PAGE_LINES = 1000
UNRUN_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_failed": "This request was not executed because the batch failed.",
}


async def finalize(store: BatchStore, owner: str, batch: Batch, *, was: str,
                   unfinished: str | None = None) -> bool:
    """Write `batch`'s files and store it (its final status set by the caller) if its status is
    still `was`; `unfinished`: the error code of the lines that never ran (None: none are left).
    Whether it was stored."""
    written: list[FileObject] = []
    output = await _write(store, batch, "output", [("completed", None)])
    error = await _write(store, batch, "error",
                         [("failed", None)] + ([(None, unfinished)] if unfinished else []))
    for file, field in ((output, "output_file_id"), (error, "error_file_id")):
        if file is not None:
            written.append(file)
            setattr(batch, field, file.id)
    if await store.finish_batch(owner, batch, written, was=was):
        return True
    for file in written:
        store.file_path(file.id).unlink(missing_ok=True)
    return False


async def _write(store: BatchStore, batch: Batch, kind: str,
                 sources: list[tuple[str | None, str | None]]) -> FileObject | None:
    """The file of the lines with each (outcome, unrun code) of `sources`; None if it would be
    empty."""
    file_id = f"file-{secrets.token_hex(12)}"
    path = store.file_path(file_id)
    partial = path.with_name(path.name + ".part")
    out = await asyncio.to_thread(_open_private, partial)
    count = 0
    try:
        for outcome, code in sources:
            last = 0
            while page := await store.results_page(batch.id, outcome, last, PAGE_LINES):
                text = "".join(_line(custom_id, result, code) + "\n"
                               for _, custom_id, _, result in page)
                await asyncio.to_thread(out.write, text.encode())
                count += len(page)
                last = page[-1][0]
        await asyncio.to_thread(_close, out)
        if count == 0:
            partial.unlink(missing_ok=True)
            return None
        os.replace(partial, path)
    except BaseException:
        out.close()
        partial.unlink(missing_ok=True)
        raise
    return FileObject(id=file_id, bytes=path.stat().st_size, created_at=int(time.time()),
                      filename=f"{batch.id}_{kind}.jsonl", purpose=BATCH_OUTPUT_PURPOSE)


def _line(custom_id: str, result: str | None, code: str | None) -> str:
    if result is not None:
        return result
    assert code is not None
    return BatchOutputLine(id=f"batch_req_{secrets.token_hex(16)}", custom_id=custom_id,
                           error=BatchLineError(code=code, message=UNRUN_MESSAGES[code])).model_dump_json()


def _open_private(path: Path):
    return open(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "wb")


def _close(out) -> None:
    out.flush()
    os.fsync(out.fileno())
    out.close()
