"""The web UI's only way to generate: the official OpenAI async client against the gateway.

`GatewayClient.stream_chat` yields text deltas and closes the HTTP stream however the consumer
stops (exhaustion, an exception, `aclose()`, or the consuming task being cancelled by Gradio's
Stop). Closing the stream is what aborts the request server-side: the gateway sees the client
disconnect and aborts the generation on the worker, freeing its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx
import openai

from llmplatform.webui.settings import WebUISettings

logger = logging.getLogger("llmplatform.webui")

CONNECT_TIMEOUT_S = 5.0


class GatewayError(Exception):
    """The gateway refused or failed a request; `str()` is the gateway's own message."""


@dataclass(frozen=True)
class SamplingControls:
    """What the UI's sliders set, passed as-is to the chat completions request."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512


def describe_error(exc: BaseException, api_base: str) -> str:
    """The error's own text, as the gateway put it, for showing in the chat.

    The gateway answers OpenAI's envelope `{"error": {"message", ...}}`; the openai client keeps
    the inner object as `body`, so its `message` is what the gateway said. An error inside a
    stream (an `error` event) arrives as a plain APIError whose message is already that text.
    """
    if isinstance(exc, openai.APIStatusError):
        body = exc.body
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            return f"{body['message']} (HTTP {exc.status_code})"
        return exc.message
    if isinstance(exc, openai.APITimeoutError):
        return f"the gateway at {api_base} did not answer in time"
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        detail = f": {type(cause).__name__}: {cause}" if cause else ""
        return f"cannot reach the gateway at {api_base}{detail}"
    if isinstance(exc, openai.APIError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"


class GatewayClient:
    """One AsyncOpenAI client for the whole UI (it pools connections across sessions)."""

    def __init__(self, settings: WebUISettings) -> None:
        self.api_base = settings.api_base
        self._client = openai.AsyncOpenAI(
            base_url=settings.api_base,
            # The client insists on a key; a gateway without keys ignores whatever is sent.
            api_key=settings.api_key or "none",
            timeout=httpx.Timeout(settings.request_timeout, connect=CONNECT_TIMEOUT_S),
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
            raise GatewayError(describe_error(exc, self.api_base)) from exc

    async def stream_chat(
        self, model: str, messages: Sequence[dict[str, str]], controls: SamplingControls
    ) -> AsyncIterator[str]:
        """Yield the answer's text deltas as they arrive; raises GatewayError."""
        try:
            stream = await self._client.chat.completions.create(
                model=model,
                messages=list(messages),  # type: ignore[arg-type]
                temperature=controls.temperature,
                top_p=controls.top_p,
                max_tokens=controls.max_tokens,
                stream=True,
            )
        except openai.OpenAIError as exc:
            raise GatewayError(describe_error(exc, self.api_base)) from exc
        try:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
        except openai.OpenAIError as exc:
            raise GatewayError(describe_error(exc, self.api_base)) from exc
        finally:
            # Runs on GeneratorExit (aclose) and CancelledError (Stop) too: the disconnect is the
            # abort signal, so the stream must never be left open for the GC to find.
            await stream.close()
