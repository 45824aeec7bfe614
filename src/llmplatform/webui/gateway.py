"""The web UI's only way to generate: the official OpenAI async client against the gateway.

`GatewayClient.stream_chat` yields the answer so far (`replies.Reply`: text, tool calls, finish
reason; the openai library's own accumulator joins the chunks) and closes the HTTP stream however
the consumer stops (exhaustion, an exception, `aclose()`, or the consuming task being cancelled
by Gradio's Stop). Closing the stream is what aborts the request server-side: the gateway sees the client
disconnect and aborts the generation on the worker, freeing its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

from llmplatform.webui.replies import Reply, reply_of
from llmplatform.webui.settings import WebUISettings

logger = logging.getLogger("llmplatform.webui")

CONNECT_TIMEOUT_S = 5.0


class GatewayError(Exception):
    """The gateway refused or failed a request; `str()` is safe to show to the visitor."""


@dataclass(frozen=True)
class RequestControls:
    """What the UI's controls set, passed as-is to the chat completions request."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    json_mode: bool = False
    """Ask for `response_format={"type": "json_object"}` (nothing is sent when off)."""
    tools: tuple[dict[str, Any], ...] = ()
    """OpenAI `tools`, as the visitor wrote them (the gateway validates them); none: not sent."""
    tool_choice: str | None = None
    """Sent with `tools` only; None leaves the gateway's default ("auto")."""

    def optional_fields(self) -> dict[str, Any]:
        """The request's fields that are sent only when set."""
        fields: dict[str, Any] = {}
        if self.json_mode:
            fields["response_format"] = {"type": "json_object"}
        if self.tools:
            fields["tools"] = list(self.tools)
            if self.tool_choice is not None:
                fields["tool_choice"] = self.tool_choice
        return fields


MAX_SHOWN_MESSAGE_CHARS = 300
"""The longest refusal text of the gateway the visitor sees (the rest is cut)."""

_VISITORS_OWN = frozenset({400, 404, 409, 413, 422})
"""Statuses that answer the visitor's own request (a bad value, an unknown model, a prompt too
long): the gateway's `message` says what to change. Anything else is the platform's business."""


def describe_error(exc: BaseException) -> str:
    """A short message for the visitor; the details go to the log (`log_error`).

    Only a refusal of the visitor's own request shows the gateway's words (OpenAI's error
    `message`). Everything else (a 5xx, an auth failure of the UI's own key, a timeout, no
    connection, an error inside a stream) shows a fixed sentence with the status at most: no
    exception text, no address, nothing a worker said.
    """
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        if status in _VISITORS_OWN:
            message = _gateway_message(exc.body)
            if message:
                return f"{_shorten(message)} (HTTP {status})"
        if status == 429:
            return "too many requests right now (HTTP 429); try again shortly"
        return f"the model is unavailable (HTTP {status}); try again"
    if isinstance(exc, openai.APITimeoutError):
        return "the model did not answer in time; try again"
    if isinstance(exc, openai.APIConnectionError):
        return "the model is unavailable (the gateway cannot be reached); try again"
    if isinstance(exc, openai.APIError):  # an `error` event inside the stream
        code = _status_code(exc.body)
        message = _gateway_message(exc.body)
        if code in _VISITORS_OWN and message:
            return f"{_shorten(message)} (HTTP {code})"
        return "the answer failed part-way; try again"
    return "the model is unavailable; try again"


def log_error(what: str, exc: BaseException) -> None:
    """The whole story for the operator: the exception, its status and body, its cause."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    logger.warning("%s failed: %s: %s (status=%s body=%r cause=%r)", what, type(exc).__name__,
                   exc, status, body, exc.__cause__)


def _gateway_message(body: object) -> str | None:
    # The openai client keeps the envelope's inner object (`{"message", "type", "code"}`) as
    # `body`; some servers put the envelope itself there.
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"].strip() or None
    return None


def _status_code(body: object) -> int | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    code = body.get("code") if isinstance(body, dict) else None
    if isinstance(code, int):
        return code
    if isinstance(code, str) and code.isdigit():
        return int(code)
    return None


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_SHOWN_MESSAGE_CHARS:
        return text
    return text[: MAX_SHOWN_MESSAGE_CHARS - 3] + "..."


class GatewayClient:
    """One AsyncOpenAI client for the whole UI (it pools connections across sessions)."""

    def __init__(self, settings: WebUISettings) -> None:
        self.api_base = settings.api_base
        self._client = openai.AsyncOpenAI(
            base_url=settings.api_base,
            # The client insists on a key; a gateway without keys ignores whatever is sent.
            api_key=settings.api_key or "none",
            timeout=openai.Timeout(settings.request_timeout, connect=CONNECT_TIMEOUT_S),
            # A retry would hide a refusal behind a delay and could start a second generation.
            max_retries=0,
        )

    async def close(self) -> None:
        await self._client.close()

    async def list_models(self) -> list[str]:
        """Model ids from `/v1/models`, sorted; raises GatewayError."""
        try:
            page = await self._client.models.list()
            return sorted(model.id for model in page.data)
        except openai.OpenAIError as exc:
            log_error("listing models", exc)
            raise GatewayError(describe_error(exc)) from exc

    async def stream_chat(
        self, model: str, messages: Sequence[dict[str, str]], controls: RequestControls
    ) -> AsyncIterator[Reply]:
        """Yield the answer so far each time it grows; raises GatewayError."""
        try:
            stream = await self._client.chat.completions.create(
                model=model,
                messages=list(messages),  # type: ignore[arg-type]
                temperature=controls.temperature,
                top_p=controls.top_p,
                max_tokens=controls.max_tokens,
                stream=True,
                **controls.optional_fields(),
            )
        except openai.OpenAIError as exc:
            log_error(f"chat with {model!r}", exc)
            raise GatewayError(describe_error(exc)) from exc
        # No tools or response format given to the accumulator: it only joins, never parses (a
        # parse failure or a "length" finish would raise).
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        reply = Reply()
        try:
            async for chunk in stream:
                state.handle_chunk(chunk)
                choices = state.current_completion_snapshot.choices
                if not choices:
                    continue
                latest = reply_of(choices[0].message, choices[0].finish_reason)
                if latest != reply:
                    reply = latest
                    yield reply
        except openai.OpenAIError as exc:
            log_error(f"chat with {model!r} (streaming)", exc)
            raise GatewayError(describe_error(exc)) from exc
        finally:
            # Runs on GeneratorExit (aclose) and CancelledError (Stop) too: the disconnect is the
            # abort signal, so the stream must never be left open for the GC to find.
            await stream.close()
