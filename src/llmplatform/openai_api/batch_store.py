"""Files and batches, kept durably: file contents in a folder, everything else in SQLite.

One database (openai_api.sqlite_db: its own thread, opened on first use) holds three tables:
``files`` (each file's object), ``batches`` (each batch's object, its status and its counters) and
``batch_lines`` (each request of a batch still running: the request, and once it has finished,
its output line). A line's result and the batch's counters are written in one transaction, and
only over a line not finished yet: a finished line is never run again, after a restart either
(openai_api.batch_runner reads only unfinished lines). When a batch ends, its output and error
files are written from its lines, registered, and the lines dropped, in that order.

A file's bytes live at ``<files folder>/<file id>``; a row is written only once its file is in
place, and a file with no row (a crash between the two) is removed at the next start
(:meth:`BatchStore.sweep`). Every object is visible only to the tenant (API key; client address
without keys) that made it: another gets the same 404 as for an id that never existed.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from llmplatform.errors import LLMPlatformError
from llmplatform.openai_api.sqlite_db import SqliteThread, database_path
from llmplatform.protocol.batches import ACTIVE_STATUSES, Batch, FileObject
from llmplatform.utils.cache_folder import cache_dir, private_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    object TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    object TEXT NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    request TEXT NOT NULL,
    outcome TEXT,
    result TEXT,
    PRIMARY KEY (batch_id, line)
);
"""
_ACTIVE = ",".join(f"'{status}'" for status in ACTIVE_STATUSES)


class FileNotFoundInStoreError(LLMPlatformError):
    """No file with that id for this tenant (HTTP 404, as OpenAI answers)."""

    http_status = 404
    openai_type = "invalid_request_error"


class BatchNotFoundError(LLMPlatformError):
    """No batch with that id for this tenant (HTTP 404)."""

    http_status = 404
    openai_type = "invalid_request_error"


@dataclass(frozen=True)
class PendingLine:
    line: int
    """Its place in the input (1-based line of the input file)."""
    custom_id: str
    request: str
    """The input line's JSON, as validated."""


@dataclass(frozen=True)
class LineResult:
    outcome: str
    """``completed`` (answered 2xx) or ``failed``."""
    result: str
    """The output line's JSON."""
    input_tokens: int = 0
    output_tokens: int = 0


class BatchStore:
    def __init__(self, database: str | None, files_dir: str | None) -> None:
        self._files_dir = files_dir
        self._database = database
        self._db = SqliteThread(lambda: database_path(database, ("batches", "batches.sqlite3"),
                                                      what="batches store"),
                                _SCHEMA, thread_name="batches-store")

    def files_folder(self) -> Path:
        """The folder file contents live in (created 0700 on first use)."""
        if self._files_dir is None:
            return private_dir("files")
        folder = Path(self._files_dir).expanduser()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder

    def exists(self) -> bool:
        """Whether the database is there already (a gateway that has never stored a file or a
        batch has nothing to resume, and does not create it at start)."""
        if self._database is None:  # without creating the cache folder
            return (cache_dir() / "batches" / "batches.sqlite3").exists()
        path = database_path(self._database, what="batches store")
        return isinstance(path, Path) and path.exists()

    def file_path(self, file_id: str) -> Path:
        return self.files_folder() / file_id

    async def aclose(self) -> None:
        await self._db.aclose()

    # ---- files ------------------------------------------------------------------------------

    async def add_file(self, owner: str, file: FileObject) -> None:
        """Register `file`, whose bytes are already at :meth:`file_path`."""
        await self._db.run(_insert_file, owner, file)

    async def get_file(self, owner: str, file_id: str) -> FileObject:
        row = await self._db.run(_one, "SELECT object FROM files WHERE id = ? AND owner = ?",
                                 (file_id, owner))
        if row is None:
            raise FileNotFoundInStoreError(f"No such File object: {file_id}", param="file_id")
        return FileObject.model_validate_json(row)

    async def list_files(self, owner: str, *, purpose: str | None, after: str | None, limit: int,
                         newest_first: bool) -> tuple[list[FileObject], bool]:
        """A page of `owner`'s files after the file `after` (None: from the start), and whether
        more follow."""
        rows = await self._db.run(_page, "files", owner, after, limit, newest_first,
                                  ("purpose", purpose) if purpose is not None else None)
        return [FileObject.model_validate_json(r) for r in rows[:limit]], len(rows) > limit

    async def delete_file(self, owner: str, file_id: str) -> None:
        """The row first, then the bytes: a crash between leaves a file :meth:`sweep` removes."""
        if not await self._db.run(_delete_file, owner, file_id):
            raise FileNotFoundInStoreError(f"No such File object: {file_id}", param="file_id")
        await asyncio.to_thread(self.file_path(file_id).unlink, missing_ok=True)

    async def sweep(self) -> list[str]:
        """Remove contents with no row (a crash between writing a file and registering it, or
        between unregistering and removing it); returns their names."""
        known = set(await self._db.run(_column, "SELECT id FROM files", ()))
        return await asyncio.to_thread(_remove_unknown, self.files_folder(), known)

    # ---- batches ----------------------------------------------------------------------------

    async def add_batch(self, owner: str, batch: Batch) -> None:
        await self._db.run(_execute, "INSERT INTO batches (id, owner, status, object) VALUES (?, ?, ?, ?)",
                           (batch.id, owner, batch.status, batch.model_dump_json()))

    async def get_batch(self, owner: str, batch_id: str) -> Batch:
        found = await self._db.run(_batches, "WHERE id = ? AND owner = ?", (batch_id, owner))
        if not found:
            raise BatchNotFoundError(f"No batch found with id '{batch_id}'.", param="batch_id")
        return found[0][1]

    async def list_batches(self, owner: str, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """A page of `owner`'s batches, newest first, after the batch `after`."""
        seq = await self._db.run(_after_seq, "batches", owner, after)
        found = await self._db.run(_batches, "WHERE owner = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                                   (owner, seq, limit + 1))
        return [batch for _, batch in found[:limit]], len(found) > limit

    async def active_batches(self) -> list[tuple[str, Batch]]:
        """(owner, batch) of every batch the runner still has work for, oldest first."""
        return await self._db.run(_batches, f"WHERE status IN ({_ACTIVE}) ORDER BY seq", ())

    async def save_batch(self, batch: Batch, *, only_if: tuple[str, ...] | None = None) -> bool:
        """Write `batch`'s object and status (its counters are the store's); with `only_if`,
        only while its stored status is one of those. Whether it was written."""
        return await self._db.run(_save_batch, batch, only_if)

    async def start_lines(self, batch: Batch, lines: list[PendingLine]) -> bool:
        """Store a validated batch's lines and its new status, at once, if it is still
        ``validating`` (whether it was)."""
        return await self._db.run(_start_lines, batch, lines)

    async def pending_lines(self, batch_id: str, after_line: int, limit: int) -> list[PendingLine]:
        rows = await self._db.run(_rows, "SELECT line, custom_id, request FROM batch_lines "
                                  "WHERE batch_id = ? AND outcome IS NULL AND line > ? "
                                  "ORDER BY line LIMIT ?", (batch_id, after_line, limit))
        return [PendingLine(*row) for row in rows]

    async def finish_line(self, batch_id: str, line: int, result: LineResult) -> bool:
        """Record a line's result and count it, unless it was recorded already (False)."""
        return await self._db.run(_finish_line, batch_id, line, result)

    async def results_page(self, batch_id: str, outcome: str | None, after_line: int,
                           limit: int) -> list[tuple[int, str, str, str | None]]:
        """(line, custom_id, request, result) of the batch's lines with `outcome` (None: the
        unfinished ones) after `after_line`, in input order."""
        where = "outcome IS NULL" if outcome is None else "outcome = ?"
        return await self._db.run(
            _rows, f"SELECT line, custom_id, request, result FROM batch_lines WHERE batch_id = ? "
            f"AND {where} AND line > ? ORDER BY line LIMIT ?",
            (batch_id, *(() if outcome is None else (outcome,)), after_line, limit))

    async def finish_batch(self, owner: str, batch: Batch, files: list[FileObject], *,
                           was: str) -> bool:
        """Register the batch's output files, write its final object and drop its lines, at
        once, if its status is still `was` (whether it was)."""
        return await self._db.run(_finish_batch, owner, batch, files, was)


def _remove_unknown(folder: Path, known: set[str]) -> list[str]:
    orphans = [name for name in os.listdir(folder) if name not in known]
    for name in orphans:
        (folder / name).unlink(missing_ok=True)
    return orphans


# ---- on the store's thread ------------------------------------------------------------------

def _execute(db: sqlite3.Connection, sql: str, args: tuple) -> int:
    with db:
        return db.execute(sql, args).rowcount


def _one(db: sqlite3.Connection, sql: str, args: tuple):
    row = db.execute(sql, args).fetchone()
    return None if row is None else row[0]


def _column(db: sqlite3.Connection, sql: str, args: tuple) -> list:
    return [row[0] for row in db.execute(sql, args)]


def _rows(db: sqlite3.Connection, sql: str, args: tuple) -> list[tuple]:
    return db.execute(sql, args).fetchall()


def _insert_file(db: sqlite3.Connection, owner: str, file: FileObject) -> None:
    with db:
        db.execute("INSERT INTO files (id, owner, purpose, object) VALUES (?, ?, ?, ?)",
                   (file.id, owner, file.purpose, file.model_dump_json()))


def _delete_file(db: sqlite3.Connection, owner: str, file_id: str) -> bool:
    with db:
        return db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0


def _after_seq(db: sqlite3.Connection, table: str, owner: str, after: str | None) -> int:
    """The row number a page starts after: `after`'s (if it is the owner's), else past the end."""
    if after is not None:
        row = db.execute(f"SELECT seq FROM {table} WHERE id = ? AND owner = ?", (after, owner)).fetchone()
        if row is not None:
            return row[0]
    return 2**62


def _page(db: sqlite3.Connection, table: str, owner: str, after: str | None, limit: int,
          newest_first: bool, where: tuple[str, str] | None) -> list[str]:
    seq = _after_seq(db, table, owner, after)
    if not newest_first and after is None:
        seq = -1
    sql = f"SELECT object FROM {table} WHERE owner = ? AND seq {'<' if newest_first else '>'} ?"
    args: list = [owner, seq]
    if where is not None:
        sql += f" AND {where[0]} = ?"
        args.append(where[1])
    sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
    return [row[0] for row in db.execute(sql, (*args, limit + 1))]


def _batches(db: sqlite3.Connection, where: str, args: tuple) -> list[tuple[str, Batch]]:
    rows = db.execute("SELECT owner, object, completed, failed, input_tokens, output_tokens "
                      f"FROM batches {where}", args).fetchall()
    found = []
    for owner, data, completed, failed, input_tokens, output_tokens in rows:
        batch = Batch.model_validate_json(data)
        batch.request_counts.completed, batch.request_counts.failed = completed, failed
        batch.usage.input_tokens, batch.usage.output_tokens = input_tokens, output_tokens
        batch.usage.total_tokens = input_tokens + output_tokens
        found.append((owner, batch))
    return found


def _save_batch(db: sqlite3.Connection, batch: Batch, only_if: tuple[str, ...] | None) -> bool:
    sql, args = "UPDATE batches SET status = ?, object = ? WHERE id = ?", [batch.status,
                                                                           batch.model_dump_json(), batch.id]
    if only_if is not None:
        sql += f" AND status IN ({','.join('?' * len(only_if))})"
        args += only_if
    with db:
        return db.execute(sql, args).rowcount > 0


def _start_lines(db: sqlite3.Connection, batch: Batch, lines: list[PendingLine]) -> bool:
    with db:
        if not db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ? AND status = ?",
                          (batch.status, batch.model_dump_json(), batch.id, "validating")).rowcount:
            return False
        db.executemany("INSERT OR IGNORE INTO batch_lines (batch_id, line, custom_id, request) "
                       "VALUES (?, ?, ?, ?)",
                       ((batch.id, p.line, p.custom_id, p.request) for p in lines))
    return True


def _finish_line(db: sqlite3.Connection, batch_id: str, line: int, result: LineResult) -> bool:
    with db:
        written = db.execute("UPDATE batch_lines SET outcome = ?, result = ? "
                             "WHERE batch_id = ? AND line = ? AND outcome IS NULL",
                             (result.outcome, result.result, batch_id, line)).rowcount
        if written:
            counter = "completed" if result.outcome == "completed" else "failed"
            db.execute(f"UPDATE batches SET {counter} = {counter} + 1, "
                       "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? "
                       "WHERE id = ?", (result.input_tokens, result.output_tokens, batch_id))
    return written > 0


def _finish_batch(db: sqlite3.Connection, owner: str, batch: Batch, files: list[FileObject],
                  was: str) -> bool:
    with db:
        if not db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ? AND status = ?",
                          (batch.status, batch.model_dump_json(), batch.id, was)).rowcount:
            return False
        for file in files:
            db.execute("INSERT INTO files (id, owner, purpose, object) VALUES (?, ?, ?, ?)",
                       (file.id, owner, file.purpose, file.model_dump_json()))
        db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch.id,))
    return True
