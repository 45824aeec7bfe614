"""A RunPod job's input, parsed once into the gateway request it becomes.

Two forms, as worker-vllm takes them:

- OpenAI pass-through: ``{"openai_route": "/v1/chat/completions" | "/v1/completions" |
  "/v1/models", "openai_input": {...}}``: the body goes to the same route of our gateway as is
  (only a missing ``model`` is filled in with the served one, as vLLM's server does).
- Prompt: ``{"prompt": "..." | "messages": [...], "sampling_params": {...}, "stream": bool,
  "apply_chat_template": bool}``, plus the per-job batch knobs ``max_batch_size``,
  ``min_batch_size``, ``batch_size_growth_factor``. ``messages`` (or ``prompt`` with
  ``apply_chat_template``, as one user message) go to ``/v1/chat/completions``, a bare ``prompt``
  to ``/v1/completions``. ``sampling_params`` use vLLM's names; those the gateway takes under the
  same name pass through (it checks their ranges), the others are refused naming the field.

A bad input is a :class:`JobError`, answered as ``{"error": {...}}`` in the gateway's envelope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmplatform.protocol.openai import ErrorResponse
from llmplatform.serverless.config import HandlerConfig

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
OPENAI_ROUTES = (CHAT, COMPLETIONS, MODELS)
SAMPLING_PARAMS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
    "seed"})
"""vLLM SamplingParams fields our gateway takes under the same name. The rest change the output's
shape (logprobs), search (best_of, use_beam_search) or detokenization, which this form's output
(text only) cannot carry or we do not do: refused, naming the field (`openai_route` has them all
where the gateway has them)."""
DEFAULT_MAX_TOKENS = 16
"""vLLM SamplingParams' default, which worker-vllm's prompt form inherits (chat included)."""
_PASS_THROUGH_KEYS = frozenset({"openai_route", "openai_input"})
_PROMPT_KEYS = frozenset({"prompt", "messages", "sampling_params", "stream", "apply_chat_template",
                          "max_batch_size", "min_batch_size", "batch_size_growth_factor"})


class JobError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def answer(self) -> dict[str, Any]:
        return error_answer(str(self), "invalid_request_error", self.param)


def error_answer(message: str, type: str, param: str | None = None) -> dict[str, Any]:
    """The SDK's error shape (a dict with `error`) holding the gateway's envelope body."""
    return ErrorResponse.of(message, type, param).model_dump()


@dataclass(frozen=True)
class BatchSize:
    """Chunks per yield: from `minimum`, times `growth` after each yield, up to `maximum`; fixed
    at `maximum` when that cannot grow (growth <= 1 or minimum >= maximum), as worker-vllm does."""

    maximum: int
    minimum: int
    growth: float

    def sizes(self):
        """The yields' sizes, one after the other (endless)."""
        dynamic = self.growth > 1 and self.minimum < self.maximum
        size: float = self.minimum if dynamic else self.maximum
        while True:
            yield size
            if dynamic:
                size = min(size * self.growth, self.maximum)


@dataclass(frozen=True)
class OpenAIJob:
    route: str
    body: dict[str, Any] | None
    """The request body; None for GET /v1/models."""

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream") is True)


@dataclass(frozen=True)
class PromptJob:
    route: str
    body: dict[str, Any]
    stream: bool
    n: int
    batch: BatchSize


def parse_job(job_input: Any, *, model: str, config: HandlerConfig) -> OpenAIJob | PromptJob:
    if not isinstance(job_input, dict) or not job_input:
        raise JobError("the job's input must be a non-empty JSON object: {\"prompt\" | "
                       "\"messages\", ...} or {\"openai_route\", \"openai_input\"}", "input")
    if "openai_route" in job_input:
        return _openai_job(job_input, model)
    if "prompt" in job_input or "messages" in job_input:
        return _prompt_job(job_input, model, config)
    raise JobError("the job's input needs \"prompt\", \"messages\" or \"openai_route\"; it has "
                   f"{sorted(job_input)}", "input")


def _refuse_unknown(job_input: dict, known: frozenset[str]) -> None:
    unknown = sorted(set(job_input) - known)
    if unknown:
        raise JobError(f"unknown input field {unknown[0]!r} (this form takes {sorted(known)})",
                       unknown[0])


def _openai_job(job_input: dict, model: str) -> OpenAIJob:
    _refuse_unknown(job_input, _PASS_THROUGH_KEYS)
    route = job_input["openai_route"]
    if route not in OPENAI_ROUTES:
        raise JobError(f"openai_route must be one of {list(OPENAI_ROUTES)}, not {route!r}",
                       "openai_route")
    body = job_input.get("openai_input")
    if route == MODELS:
        return OpenAIJob(route, None)
    if not isinstance(body, dict):
        raise JobError(f"openai_input must be the JSON object {route} takes", "openai_input")
    return OpenAIJob(route, body if "model" in body else {"model": model, **body})


def _prompt_job(job_input: dict, model: str, config: HandlerConfig) -> PromptJob:
    _refuse_unknown(job_input, _PROMPT_KEYS)
    stream = _typed(job_input, "stream", bool, False)
    apply_template = _typed(job_input, "apply_chat_template", bool, False)
    sampling = _typed(job_input, "sampling_params", dict, {})
    for name in sampling:
        if name not in SAMPLING_PARAMS:
            raise JobError(f"sampling_params.{name} is not supported here (supported: "
                           f"{sorted(SAMPLING_PARAMS)}; openai_route takes the full OpenAI "
                           "request)", f"sampling_params.{name}")
    body: dict[str, Any] = {"model": model, "max_tokens": DEFAULT_MAX_TOKENS, **sampling}
    if "messages" in job_input:
        messages = job_input["messages"]
        if not isinstance(messages, list):
            raise JobError("messages must be a list of {\"role\", \"content\"} objects", "messages")
        route, body["messages"] = CHAT, messages
    else:
        prompt = job_input["prompt"]
        if not isinstance(prompt, str):
            raise JobError("prompt must be a string", "prompt")
        if apply_template:
            route, body["messages"] = CHAT, [{"role": "user", "content": prompt}]
        else:
            route, body["prompt"] = COMPLETIONS, prompt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    n = sampling.get("n", 1)
    batch = BatchSize(
        maximum=_positive(job_input, "max_batch_size", int, config.default_batch_size),
        minimum=_positive(job_input, "min_batch_size", int, config.min_batch_size),
        growth=_positive(job_input, "batch_size_growth_factor", (int, float),
                         config.batch_size_growth_factor))
    return PromptJob(route, body, stream, n if isinstance(n, int) and n >= 1 else 1, batch)


def _typed(job_input: dict, name: str, kind: type, default: Any) -> Any:
    value = job_input.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise JobError(f"{name} must be a {kind.__name__}, not {type(value).__name__}", name)
    return value


def _positive(job_input: dict, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = job_input.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise JobError(f"{name} must be a positive number", name)
    return value
