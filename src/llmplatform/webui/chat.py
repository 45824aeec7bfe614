"""The Chat tab's event handlers, free of Gradio so that tests can call them directly.

Each handler takes the components' values and returns (or, while streaming, yields) the new
values. Streaming handlers yield a new list each time, never the same list mutated, because
Gradio diffs successive outputs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from llmplatform.webui.gateway import GatewayClient, GatewayError, SamplingControls
from llmplatform.webui.messages import (
    Message,
    assistant_message,
    error_message,
    normalize_history,
    to_openai_messages,
    user_message,
)

logger = logging.getLogger("llmplatform.webui")

NO_MODEL = "No model selected. Pick one above (press Refresh if the list is empty)."
UNEXPECTED = "the answer failed; try again"


def controls_from(temperature: Any, top_p: Any, max_tokens: Any) -> SamplingControls:
    """Slider values (Gradio may hand back floats or None) as request parameters."""
    defaults = SamplingControls()
    return SamplingControls(
        temperature=defaults.temperature if temperature is None else float(temperature),
        top_p=defaults.top_p if top_p is None else float(top_p),
        max_tokens=defaults.max_tokens if max_tokens is None else int(max_tokens),
    )


async def stream_answer(
    client: GatewayClient,
    model: str | None,
    system_prompt: str | None,
    controls: SamplingControls,
    history: Sequence[Any] | None,
) -> AsyncIterator[list[Message]]:
    """Answer the history's last user message; yield the history after every delta.

    Ends with the answer (possibly partial) followed by an error message when the gateway
    fails. Does nothing when the last message is not the user's (nothing to answer).
    """
    base = normalize_history(history)
    if not base or base[-1]["role"] != "user":
        return
    if not model:
        yield base + [error_message(NO_MODEL)]
        return
    messages = to_openai_messages(system_prompt, base)
    text = ""
    yield base + [assistant_message(text)]
    try:
        # aclosing: when our consumer closes us at a yield (Gradio's Stop), the gateway stream
        # must close now, not whenever the garbage collector finalizes the generator.
        async with contextlib.aclosing(client.stream_chat(model, messages, controls)) as deltas:
            async for delta in deltas:
                text += delta
                yield base + [assistant_message(text)]
    except GatewayError as exc:  # already logged, with its details, by the client
        shown = str(exc)
    except Exception:  # noqa: BLE001 - e.g. a garbled stream: the visitor sees no internals
        logger.exception("chat with %r failed", model)
        shown = UNEXPECTED
    else:
        return
    answered = [assistant_message(text)] if text else []
    yield base + answered + [error_message(shown)]


class ChatHandlers:
    """Handlers of the Chat tab (and the model list shared with the Arena tab)."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client

    async def list_models(self) -> tuple[list[str], str]:
        """(model ids, a status line); an empty list and the gateway's error when it fails."""
        try:
            models = await self.client.list_models()
        except GatewayError as exc:
            return [], f"Cannot list models: {exc}"
        if not models:
            return [], "The gateway serves no model yet (no worker registered)."
        return models, f"{len(models)} model(s) available."

    @staticmethod
    def add_user_message(
        message: str | None, history: Sequence[Any] | None
    ) -> tuple[str, list[Message]]:
        """Append the textbox's text to the history and empty the textbox."""
        normalized = normalize_history(history)
        if message and message.strip():
            return "", normalized + [user_message(message.strip())]
        return message or "", normalized

    async def respond(
        self,
        model: str | None,
        system_prompt: str | None,
        temperature: Any,
        top_p: Any,
        max_tokens: Any,
        history: Sequence[Any] | None,
    ) -> AsyncIterator[list[Message]]:
        """Stream the answer to the last user message into the chat."""
        controls = controls_from(temperature, top_p, max_tokens)
        answer = stream_answer(self.client, model, system_prompt, controls, history)
        async with contextlib.aclosing(answer) as updates:
            async for updated in updates:
                yield updated
