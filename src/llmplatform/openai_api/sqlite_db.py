"""The gateway's embedded databases (stored responses, files and batches): SQLite on one thread.

Python's own ``sqlite3`` (no dependency), driven from one dedicated thread: every call is handed
to it and awaited, so the event loop never waits on the disk, and one connection serves every
call in order (SQLite serialises writers anyway). The file is opened on first use, so a gateway
that never needs a database never touches the disk. WAL mode and a busy timeout let several
gateway processes on one host share a file. What is kept is private (conversations, users'
files): the file, and SQLite's -wal/-shm files which take its mode, readable by the serving
user alone.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from llmplatform.utils.cache_folder import private_dir

T = TypeVar("T")
P = ParamSpec("P")

SQLITE_SCHEME = "sqlite:///"


def database_path(location: str | None, default: tuple[str, str] = ("responses", "responses.sqlite3"),
                  *, what: str = "responses store") -> Path | str:
    """Where a database lives: a file path, ``sqlite:///PATH`` (SQLAlchemy's spelling:
    ``sqlite:////abs/path``, ``sqlite:///rel/path``), or ``sqlite:///:memory:`` (kept in this
    process only: lost at exit). None: ``<cache folder>/<default folder>/<default file>``. Any
    other URL (``postgresql://``...) is refused: only SQLite is implemented."""
    if location is None:
        folder, name = default
        return private_dir(folder) / name
    if location.startswith(SQLITE_SCHEME):
        rest = location[len(SQLITE_SCHEME):]
        if not rest:
            raise ValueError(f"{what} {location!r} names no file")
        return rest if rest == ":memory:" else Path(rest)
    if "://" in location:
        raise ValueError(f"{what} {location.split('://')[0]}:// is not supported: give "
                         "a file path or a sqlite:/// URL (only SQLite is implemented)")
    return Path(location).expanduser()


class SqliteThread:
    """One SQLite connection, opened on first use with `schema`, used from one thread."""

    def __init__(self, path: Callable[[], Path | str], schema: str, *, thread_name: str) -> None:
        self._path = path  # resolved on first use (the default one creates the cache folder)
        self._schema = schema
        self._thread_name = thread_name
        self._conn: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None  # started by the first call

    async def run(self, fn: Callable[Concatenate[sqlite3.Connection, P], T],
                  *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(connection, *args)`` on the database's thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: fn(self._db(), *args, **kwargs))

    async def aclose(self) -> None:
        """Close the database and stop the thread (a later call starts them again: an app's
        lifespan may run more than once)."""
        if self._executor is None:
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close)
        self._executor.shutdown(wait=False)
        self._executor = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            path = self._path()
            if isinstance(path, Path):
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            conn = sqlite3.connect(str(path), timeout=5.0, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(self._schema)
            self._conn = conn
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def rows_as_dicts(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """A query's rows as dicts by column name."""
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row)) for row in cursor.fetchall()]
