"""EventStreamResponse (openai_api/sse.py) at the ASGI level: what it sends, and when."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from llmplatform.openai_api.sse import EventStreamResponse

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


async def run(response: EventStreamResponse, sent: list[dict[str, Any]],
              disconnect: asyncio.Event | None = None) -> None:
    disconnect = disconnect or asyncio.Event()

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await response(SCOPE, receive, send)


async def test_the_headers_go_out_with_the_first_event() -> None:
    first_ready = asyncio.Event()
    closed: list[bool] = []

    async def events() -> AsyncIterator[bytes]:
        await first_ready.wait()
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    async def on_close() -> None:
        closed.append(True)

    sent: list[dict[str, Any]] = []
    task = asyncio.create_task(run(EventStreamResponse(events(), on_close=on_close), sent))
    await asyncio.sleep(0.05)
    assert sent == []  # nothing, not even the headers, before there is an event to send
    first_ready.set()
    await asyncio.wait_for(task, 5)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert sent[-1]["more_body"] is False
    assert closed == [True]


async def test_an_empty_stream_still_answers() -> None:
    async def nothing() -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover

    sent: list[dict[str, Any]] = []
    await asyncio.wait_for(run(EventStreamResponse(nothing()), sent), 5)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_disconnect_before_the_first_event_sends_nothing_and_cleans_up() -> None:
    closed: list[bool] = []
    iterator_closed: list[bool] = []

    async def never() -> AsyncIterator[bytes]:
        try:
            await asyncio.Event().wait()
            yield b"data: late\n\n"
        finally:
            iterator_closed.append(True)

    async def on_close() -> None:
        closed.append(True)

    sent: list[dict[str, Any]] = []
    disconnect = asyncio.Event()
    task = asyncio.create_task(run(EventStreamResponse(never(), on_close=on_close), sent, disconnect))
    await asyncio.sleep(0.05)
    disconnect.set()
    await asyncio.wait_for(task, 5)  # ends normally: the disconnect is not an error
    assert sent == []
    assert closed == [True] and iterator_closed == [True]
