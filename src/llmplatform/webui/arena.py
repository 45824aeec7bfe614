"""The Arena tab: two models answer the same prompt side by side; people vote.

Both answers stream at once: each side runs in its own task and posts its latest history to
one queue; the handler yields the pair whenever either side moved. Stopping (Gradio cancels the
handler or closes it) cancels both tasks, and each closes its own gateway stream on the way out.
The *JSON mode* switch asks both models for JSON (`response_format`), shown as the Chat tab shows
it; the Arena sends no tools.

Votes are checked on the server: a session's `ArenaSession` (a `gr.State`, which Gradio keeps on
the server and never takes from a request) holds the pair of answers the server itself streamed
last, and only once both completed. A vote needs that pair and uses it up: one vote per answered
pair, whatever the page or a direct API caller sends. A vote for no pair, for a pair still
streaming, stopped or failed, or a second vote for the same pair, writes nothing. What a vote
records is the server's own copy, each text cut to `MAX_LOGGED_CHARS`, so one record is bounded.

Votes are appended, one JSON object per line, to `<log_dir>/votes.jsonl`:
`{"timestamp": ISO-8601 UTC, "vote": "a_better"|"b_better"|"tie"|"both_bad",
  "models": {"a", "b"}, "prompt": str, "answers": {"a", "b"}, "truncated": bool}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplatform.webui.chat import controls_from, stream_answer
from llmplatform.webui.gateway import GatewayClient
from llmplatform.webui.messages import (
    Message,
    is_error,
    last_exchange,
    normalize_history,
    user_message,
)

logger = logging.getLogger("llmplatform.webui")

VOTES: dict[str, str] = {
    "a_better": "A is better",
    "b_better": "B is better",
    "tie": "Tie",
    "both_bad": "Both are bad",
}
"""Vote kind (as logged) -> button label."""

MAX_LOGGED_CHARS = 8192
"""The most characters of the prompt, and of each answer, one vote record keeps."""
MAX_MODEL_NAME_CHARS = 256

NOTHING_TO_VOTE_ON = "Nothing to vote on yet: send a prompt and let both models answer."
ALREADY_VOTED = "This pair of answers already has a vote. Send a new prompt to vote again."


@dataclass
class ServedPair:
    """Two answers the server streamed, both to the end, for one prompt."""

    models: tuple[str, str]
    prompt: str
    answers: tuple[str, str]
    voted: bool = False


@dataclass
class ArenaSession:
    """One page session's arena state, held by Gradio on the server (`gr.State`)."""

    pair: ServedPair | None = None
    """The last answered pair; None while a round streams, or after one that did not complete."""

    @property
    def can_vote(self) -> bool:
        return self.pair is not None and not self.pair.voted


def _cut(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit], True)


def _completed_answer(history: list[Message]) -> str | None:
    """The answer that ends `history`, when it is a whole one (no error after it)."""
    if not history or history[-1]["role"] != "assistant" or is_error(history[-1]):
        return None
    exchange = last_exchange(history)
    return exchange[1] if exchange and exchange[1] else None


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
        session: ArenaSession | None = None,
        json_mode: Any = False,
    ) -> AsyncIterator[tuple[list[Message], list[Message], ArenaSession]]:
        """Stream both answers concurrently; yield (history_a, history_b, session) as they grow.

        The session's pair is cleared at once and set only when both answers completed."""
        session = session if isinstance(session, ArenaSession) else ArenaSession()
        session.pair = None
        controls = controls_from(temperature, top_p, max_tokens, json_mode)
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
                yield latest[0], latest[1], session
            for task in tasks:
                task.result()  # a bug in a pump surfaces here instead of vanishing
            self._remember(session, model_a, model_b, latest[0], latest[1])
            yield latest[0], latest[1], session
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _remember(session: ArenaSession, model_a: str | None, model_b: str | None,
                  history_a: list[Message], history_b: list[Message]) -> None:
        answer_a, answer_b = _completed_answer(history_a), _completed_answer(history_b)
        exchange = last_exchange(history_a)
        if not (model_a and model_b and answer_a and answer_b and exchange):
            return
        session.pair = ServedPair(models=(model_a, model_b), prompt=exchange[0],
                                  answers=(answer_a, answer_b))

    async def vote(self, kind: str, session: ArenaSession | None) -> tuple[str, ArenaSession]:
        """Log a vote on the session's answered pair, once; returns the line to show under the
        buttons and the session."""
        if kind not in VOTES:
            raise ValueError(f"unknown vote {kind!r}; expected one of {sorted(VOTES)}")
        session = session if isinstance(session, ArenaSession) else ArenaSession()
        pair = session.pair
        if pair is None:
            return NOTHING_TO_VOTE_ON, session
        if pair.voted:
            return ALREADY_VOTED, session
        pair.voted = True  # before the write: a concurrent second vote finds it taken
        prompt, cut_prompt = _cut(pair.prompt, MAX_LOGGED_CHARS)
        answer_a, cut_a = _cut(pair.answers[0], MAX_LOGGED_CHARS)
        answer_b, cut_b = _cut(pair.answers[1], MAX_LOGGED_CHARS)
        model_a, model_b = (_cut(m, MAX_MODEL_NAME_CHARS)[0] for m in pair.models)
        record = {
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
            "vote": kind,
            "models": {"a": model_a, "b": model_b},
            "prompt": prompt,
            "answers": {"a": answer_a, "b": answer_b},
            "truncated": cut_prompt or cut_a or cut_b,
        }
        try:
            await self.votes.append(record)
        except OSError as exc:
            logger.error("cannot write vote to %s: %s", self.votes.path, exc)
            return "Could not record the vote (the server could not write it).", session
        return f"Vote recorded: {VOTES[kind]} (model A: {model_a}, model B: {model_b}).", session
