"""The Arena tab: two models answer the same prompt side by side; people vote.

Both answers stream at once: each side runs in its own task and posts its latest history to
one queue; the handler yields the pair whenever either side moved. Stopping (Gradio cancels the
handler or closes it) cancels both tasks, and each closes its own gateway stream on the way out.

Votes are appended, one JSON object per line, to `<log_dir>/votes.jsonl`:
`{"timestamp": ISO-8601 UTC, "vote": "a_better"|"b_better"|"tie"|"both_bad",
  "models": {"a", "b"}, "prompt": str, "answers": {"a", "b"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from llmplatform.webui.chat import controls_from, stream_answer
from llmplatform.webui.gateway import GatewayClient
from llmplatform.webui.messages import Message, last_exchange, normalize_history, user_message

logger = logging.getLogger("llmplatform.webui")

VOTES: dict[str, str] = {
    "a_better": "A is better",
    "b_better": "B is better",
    "tie": "Tie",
    "both_bad": "Both are bad",
}
"""Vote kind (as logged) -> button label."""


class VoteLog:
    """An append-only JSON-lines file; writes go to a thread, one at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = asyncio.Lock()

    async def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        async with self._lock:
            await asyncio.to_thread(self._write, line)

    def _write(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)


class ArenaHandlers:
    def __init__(self, client: GatewayClient, votes: VoteLog) -> None:
        self.client = client
        self.votes = votes

    @staticmethod
    def add_user_message(
        message: str | None, history_a: Sequence[Any] | None, history_b: Sequence[Any] | None
    ) -> tuple[str, list[Message], list[Message]]:
        """Append the prompt to both sides and empty the textbox."""
        a, b = normalize_history(history_a), normalize_history(history_b)
        if message and message.strip():
            return "", a + [user_message(message.strip())], b + [user_message(message.strip())]
        return message or "", a, b

    async def respond(
        self,
        model_a: str | None,
        model_b: str | None,
        temperature: Any,
        top_p: Any,
        max_tokens: Any,
        history_a: Sequence[Any] | None,
        history_b: Sequence[Any] | None,
    ) -> AsyncIterator[tuple[list[Message], list[Message]]]:
        """Stream both answers concurrently; yield (history_a, history_b) as they grow."""
        controls = controls_from(temperature, top_p, max_tokens)
        latest = [normalize_history(history_a), normalize_history(history_b)]
        updates: asyncio.Queue[tuple[int, list[Message] | None]] = asyncio.Queue()

        async def pump(side: int, model: str | None, history: list[Message]) -> None:
            try:
                answer = stream_answer(self.client, model, None, controls, history)
                async with contextlib.aclosing(answer) as snapshots:
                    async for snapshot in snapshots:
                        updates.put_nowait((side, snapshot))
            finally:
                updates.put_nowait((side, None))  # this side is done (or failed)

        tasks = [
            asyncio.create_task(pump(0, model_a, latest[0]), name="arena-a"),
            asyncio.create_task(pump(1, model_b, latest[1]), name="arena-b"),
        ]
        try:
            running = len(tasks)
            while running:
                batch = [await updates.get()]
                while not updates.empty():  # coalesce: one UI update per wake-up
                    batch.append(updates.get_nowait())
                for side, snapshot in batch:
                    if snapshot is None:
                        running -= 1
                    else:
                        latest[side] = snapshot
                yield latest[0], latest[1]
            for task in tasks:
                task.result()  # a bug in a pump surfaces here instead of vanishing
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def vote(
        self,
        kind: str,
        model_a: str | None,
        model_b: str | None,
        history_a: Sequence[Any] | None,
        history_b: Sequence[Any] | None,
    ) -> str:
        """Log a vote on the last exchange; returns the line to show under the buttons."""
        if kind not in VOTES:
            raise ValueError(f"unknown vote {kind!r}; expected one of {sorted(VOTES)}")
        exchange_a, exchange_b = last_exchange(history_a), last_exchange(history_b)
        if exchange_a is None or exchange_b is None:
            return "Nothing to vote on yet: send a prompt and let both models answer."
        record = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
            "vote": kind,
            "models": {"a": model_a, "b": model_b},
            "prompt": exchange_a[0],
            "answers": {"a": exchange_a[1], "b": exchange_b[1]},
        }
        try:
            await self.votes.append(record)
        except OSError as exc:
            logger.error("cannot write vote to %s: %s", self.votes.path, exc)
            return f"Could not record the vote: {exc}"
        return f"Vote recorded: {VOTES[kind]} (model A: {model_a}, model B: {model_b})."
