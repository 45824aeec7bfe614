"""The stored responses' SQLite database: per-tenant visibility, retention, persistence."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from llmplatform.openai_api.response_store import (
    ResponseNotFoundError,
    ResponseStore,
    StoredResponse,
    database_path,
)
from llmplatform.openai_api.settings import GatewaySettings


def stored(text: str) -> StoredResponse:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    return StoredResponse({"id": "x", "model": "m", "output": output},
                          [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}],
                          [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "h"}]}])


def run(coro):
    return asyncio.run(coro)


def test_a_response_is_seen_by_its_owner_only_and_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.sqlite3"

    async def first() -> None:
        store = ResponseStore(str(path), max_age_s=None, max_count=None)
        await store.put("key:a", "resp_1", stored("hello"))
        got = await store.get("key:a", "resp_1")
        assert got.response["output"][0]["content"][0]["text"] == "hello"
        assert [i["content"][0]["text"] for i in got.conversation()[:2]] == ["h", "q"]
        with pytest.raises(ResponseNotFoundError):
            await store.get("key:b", "resp_1")
        with pytest.raises(ResponseNotFoundError):
            await store.delete("key:b", "resp_1")
        await store.aclose()

    async def second() -> None:
        store = ResponseStore(f"sqlite:///{path}", max_age_s=None, max_count=None)
        assert (await store.get("key:a", "resp_1")).response["id"] == "x"
        await store.aclose()  # closed, then used again (an app's lifespan can run twice)
        await store.delete("key:a", "resp_1")
        with pytest.raises(ResponseNotFoundError):
            await store.get("key:a", "resp_1")
        await store.aclose()

    run(first())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # conversations are private
    run(second())


def test_retention_by_count_and_by_age(tmp_path: Path) -> None:
    now = [1000.0]

    async def go() -> None:
        store = ResponseStore(str(tmp_path / "r.sqlite3"), max_age_s=60, max_count=2,
                              clock=lambda: now[0])
        for n in range(3):
            await store.put("o", f"r{n}", stored(str(n)))
        with pytest.raises(ResponseNotFoundError):
            await store.get("o", "r0")  # the oldest beyond the count
        await store.get("o", "r1")
        now[0] += 61  # r1 and r2 are now too old: gone at once, before any write
        with pytest.raises(ResponseNotFoundError):
            await store.get("o", "r2")
        await store.put("o", "r3", stored("3"))
        assert (await store.get("o", "r3")).response["id"] == "x"
        await store.aclose()

    run(go())


def test_store_locations() -> None:
    assert database_path("sqlite:////abs/r.db") == Path("/abs/r.db")
    assert database_path("sqlite:///rel/r.db") == Path("rel/r.db")
    assert database_path("sqlite:///:memory:") == ":memory:"
    assert database_path("/x/r.db") == Path("/x/r.db")
    for bad in ("postgresql://db/responses", "sqlite:///"):
        with pytest.raises(ValueError):
            database_path(bad)
    with pytest.raises(ValueError, match="only SQLite"):
        GatewaySettings(responses_store="mysql://host/db")
    with pytest.raises(ValueError):
        GatewaySettings(responses_max_count=0)
