"""What the gateway learns once per (worker, model) and keeps: the worker's `/model_details`
and, for a stock FastChat worker, its conversation template (`/worker_get_conv_template`).

A worker's model is fixed, so FastChat's gateway caches these too. Each cache is bounded: past
`MAX_ENTRIES` (a thousand worker and model pairs) it starts over.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from llmplatform.conversation import ConvTemplate
from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.errors import UpstreamError

MAX_ENTRIES = 1024

PostJson = Callable[[str, Any], Awaitable[Any]]
"""POSTs a JSON payload to a worker's URL and returns its JSON answer (errors typed)."""


@dataclass(frozen=True)
class ModelDetails:
    """A worker's `/model_details` answer, read."""

    context_length: int
    extensions: frozenset[str]
    """The params-dict additions the worker understands (our protocol's `messages`,
    `openai_max_tokens`, ...); a stock FastChat worker lists none."""
    tool_call_parser: str | None
    """The syntax the model writes tool calls in; None: it serves no tools."""
    reasoning_parser: str | None
    """The syntax of the model's thoughts (protocol.reasoning); None: its output is all answer."""
    raw: Mapping[str, Any]
    """The answer as sent (ours adds `tasks`, `embedding`)."""

    @classmethod
    def parse(cls, data: Any, url: str) -> ModelDetails:
        if not isinstance(data, dict) or not isinstance(data.get("context_length"), int):
            raise UpstreamError(f"The worker at {url} answered with an invalid response (no context length).")
        extensions, parser = data.get("params"), data.get("tool_call_parser")
        return cls(
            context_length=data["context_length"],
            extensions=frozenset(e for e in extensions if isinstance(e, str))
            if isinstance(extensions, list) else frozenset(),
            tool_call_parser=parser if isinstance(parser, str) else None,
            reasoning_parser=(data["reasoning_parser"]
                              if isinstance(data.get("reasoning_parser"), str) else None),
            raw=data,
        )

    def check_generates(self, model: str) -> None:
        """Refuses chat and completions for a model whose worker (ours) says it serves no
        generation (``tasks``: an embedding model), before anything is sent for it; the worker
        refuses too. A stock FastChat worker announces no tasks and is taken at its word."""
        tasks = self.raw.get("tasks")
        if isinstance(tasks, list) and "generate" not in tasks:
            what = ("a cross-encoder (reranker): it serves /v1/rerank and /v1/score"
                    if "score" in tasks else "an embedding model: it serves /v1/embeddings")
            raise InvalidRequestError(
                f"model {model!r} is {what}, not chat or completions (GET /v1/models lists what "
                "each model serves)", param="model")


K = TypeVar("K")
V = TypeVar("V")


def _put(cache: dict[K, V], key: K, value: V) -> V:
    if len(cache) >= MAX_ENTRIES:
        cache.clear()
    cache[key] = value
    return value


class WorkerDetails:
    """The caches, filled on first use through `post_json`."""

    def __init__(self, post_json: PostJson) -> None:
        self._post_json = post_json
        self._details: dict[tuple[str, str], ModelDetails] = {}
        self._conv_templates: dict[tuple[str, str], ConvTemplate] = {}

    async def model_details(self, address: str, model: str) -> ModelDetails:
        cached = self._details.get((address, model))
        if cached is not None:
            return cached
        url = f"{address}/model_details"
        details = ModelDetails.parse(await self._post_json(url, {"model": model}), url)
        return _put(self._details, (address, model), details)

    async def conv_template(self, address: str, model: str) -> ConvTemplate:
        cached = self._conv_templates.get((address, model))
        if cached is not None:
            return cached
        url = f"{address}/worker_get_conv_template"
        data = await self._post_json(url, {"model": model})
        if not isinstance(data, dict) or not isinstance(data.get("conv"), dict):
            raise UpstreamError(f"The worker at {url} answered without a conversation template.")
        return _put(self._conv_templates, (address, model), ConvTemplate.from_dict(data["conv"]))
