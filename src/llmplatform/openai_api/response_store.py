"""Stored responses (``store: true``): kept in an embedded SQLite database, per tenant.

Each row is one response as it was answered, the input items of its request and the items of
the conversation it continued (``history``): a continuation (``previous_response_id``) needs one
row, and a conversation survives its ancestors being deleted or expiring.

The database is SQLite on its own thread (openai_api.sqlite_db), opened on first use, so a
gateway that never serves a Responses request never touches the disk.

Retention: a row older than ``max_age_s`` is treated as gone at once and deleted at the next
write; beyond ``max_count`` rows, the oldest are deleted as new ones are written. A row is
visible only to the tenant (API key; client address without keys) that created it: another
tenant gets the same 404 as for an id that never existed.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmplatform.errors import LLMPlatformError
from llmplatform.openai_api.sqlite_db import SqliteThread, database_path

__all__ = ["ResponseNotFoundError", "ResponseStore", "StoredResponse", "database_path"]

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
        self._max_age_s = max_age_s
        self._max_count = max_count
        self._clock = clock
        self._db = SqliteThread(lambda: database_path(location), _SCHEMA,
                                thread_name="responses-store")

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        await self._db.run(self._put, owner, response_id, stored)

    async def get(self, owner: str, response_id: str) -> StoredResponse:
        """Raises ResponseNotFoundError if there is none this `owner` may see."""
        found = await self._db.run(self._get, owner, response_id)
        if found is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")
        return found

    async def delete(self, owner: str, response_id: str) -> None:
        if not await self._db.run(self._delete, owner, response_id):
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")

    async def aclose(self) -> None:
        """Close the database and stop its thread (a later call opens it again)."""
        await self._db.aclose()

    # ---- on the store's thread ------------------------------------------------------------

    def _oldest_visible(self) -> float:
        return self._clock() - self._max_age_s if self._max_age_s is not None else float("-inf")

    def _put(self, db: sqlite3.Connection, owner: str, response_id: str, stored: StoredResponse) -> None:
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

    def _get(self, db: sqlite3.Connection, owner: str, response_id: str) -> StoredResponse | None:
        row = db.execute(
            "SELECT response, input_items, history FROM responses "
            "WHERE id = ? AND owner = ? AND created_at >= ?",
            (response_id, owner, self._oldest_visible())).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    def _delete(self, db: sqlite3.Connection, owner: str, response_id: str) -> bool:
        with db:
            cursor = db.execute("DELETE FROM responses WHERE id = ? AND owner = ? AND created_at >= ?",
                                (response_id, owner, self._oldest_visible()))
        return cursor.rowcount > 0
