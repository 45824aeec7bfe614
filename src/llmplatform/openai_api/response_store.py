"""Stored responses (``store: true``): kept in an embedded SQLite database, per tenant.

Each row is one response as it was answered, the input items of its request and the items of
the conversation it continued (``history``): a continuation (``previous_response_id``) needs one
row, and a conversation survives its ancestors being deleted or expiring.

The database is Python's own ``sqlite3`` (no dependency), driven from one dedicated thread: every
call is handed to it and awaited, so the event loop never waits on the disk, and one connection
serves every call in order (SQLite serialises writers anyway). It is opened on first use, so a
gateway that never serves a Responses request never touches the disk. WAL mode and a busy
timeout let several gateway processes on one host share the file.

Retention: a row older than ``max_age_s`` is treated as gone at once and deleted at the next
write; beyond ``max_count`` rows, the oldest are deleted as new ones are written. A row is
visible only to the tenant (API key; client address without keys) that created it: another
tenant gets the same 404 as for an id that never existed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from llmplatform.errors import LLMPlatformError
from llmplatform.utils.cache_folder import private_dir

T = TypeVar("T")

SQLITE_SCHEME = "sqlite:///"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    history TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


class ResponseNotFoundError(LLMPlatformError):
    """No stored response with that id for this tenant (HTTP 404, as OpenAI answers)."""

    http_status = 404
    openai_type = "invalid_request_error"


def database_path(location: str | None) -> Path | str:
    """Where the database lives: a file path, ``sqlite:///PATH`` (SQLAlchemy's spelling:
    ``sqlite:////abs/path``, ``sqlite:///rel/path``), or ``sqlite:///:memory:`` (kept in this
    process only: lost at exit). None: ``<cache folder>/responses/responses.sqlite3``. Any other
    URL (``postgresql://``...) is refused: only SQLite is implemented."""
    if location is None:
        return private_dir("responses") / "responses.sqlite3"
    if location.startswith(SQLITE_SCHEME):
        rest = location[len(SQLITE_SCHEME):]
        if not rest:
            raise ValueError(f"responses store {location!r} names no file")
        return rest if rest == ":memory:" else Path(rest)
    if "://" in location:
        raise ValueError(f"responses store {location.split('://')[0]}:// is not supported: give "
                         "a file path or a sqlite:/// URL (only SQLite is implemented)")
    return Path(location).expanduser()


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object as it was answered."""
    input_items: list[dict[str, Any]]
    """This request's own input items (``GET /v1/responses/{id}/input_items``)."""
    history: list[dict[str, Any]]
    """The items of the conversation it continued, oldest first (empty for a first turn)."""

    def conversation(self) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this response's output: what a
        continuation puts before its own input."""
        return [*self.history, *self.input_items, *self.response.get("output", [])]


class ResponseStore:
    def __init__(self, location: str | None, *, max_age_s: float | None,
                 max_count: int | None, clock: Callable[[], float] = time.time) -> None:
        self._location = location
        self._max_age_s = max_age_s
        self._max_count = max_count
        self._clock = clock
        self._conn: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None  # started by the first call

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        await self._run(self._put, owner, response_id, stored)

    async def get(self, owner: str, response_id: str) -> StoredResponse:
        """Raises ResponseNotFoundError if there is none this `owner` may see."""
        found = await self._run(self._get, owner, response_id)
        if found is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")
        return found

    async def delete(self, owner: str, response_id: str) -> None:
        if not await self._run(self._delete, owner, response_id):
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")

    async def aclose(self) -> None:
        """Close the database and stop the thread (a later call starts them again: an app's
        lifespan may run more than once)."""
        if self._executor is None:
            return
        await self._run(self._close)
        self._executor.shutdown(wait=False)
        self._executor = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- on the store's thread ------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            path = database_path(self._location)
            if isinstance(path, Path):
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                # Conversations are private: the file (and SQLite's -wal/-shm files, which take
                # its mode) readable by the serving user alone.
                os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            conn = sqlite3.connect(str(path), timeout=5.0, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    def _oldest_visible(self) -> float:
        return self._clock() - self._max_age_s if self._max_age_s is not None else float("-inf")

    def _put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        db = self._db()
        with db:
            cursor = db.execute(
                "INSERT INTO responses (id, owner, created_at, response, input_items, history) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (response_id, owner, self._clock(), json.dumps(stored.response),
                 json.dumps(stored.input_items), json.dumps(stored.history)))
            if self._max_age_s is not None:
                db.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest_visible(),))
            if self._max_count is not None and cursor.lastrowid is not None:
                # seq only grows: the rows above lastrowid - max_count are the newest max_count.
                db.execute("DELETE FROM responses WHERE seq <= ?", (cursor.lastrowid - self._max_count,))

    def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        row = self._db().execute(
            "SELECT response, input_items, history FROM responses "
            "WHERE id = ? AND owner = ? AND created_at >= ?",
            (response_id, owner, self._oldest_visible())).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    def _delete(self, owner: str, response_id: str) -> bool:
        db = self._db()
        with db:
            cursor = db.execute("DELETE FROM responses WHERE id = ? AND owner = ? AND created_at >= ?",
                                (response_id, owner, self._oldest_visible()))
        return cursor.rowcount > 0

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
