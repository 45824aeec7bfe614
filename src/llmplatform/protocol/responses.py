"""OpenAI's Responses API (``/v1/responses``) as the gateway speaks it: contracts only.

The request is parsed like the chat one (strict JSON types, unknown fields ignored, ``null``
meaning "the default"). Input items, tools and ``text.format`` stay plain JSON here: they are
checked item by item where they are translated to the chat request (openai_api.responses_input),
so that an error names the item at fault (``input[2].content[0].type``).

Fields that would change generation and are not served are declared only to be refused by name
(:data:`REFUSED_FIELDS`); ``reasoning`` is served in part (:class:`ReasoningConfig`); fields
that do not change generation (``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``...)
are accepted, and ``metadata`` is stored and echoed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    format: dict[str, Any] | None = None
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name",
    "schema", "strict", "description"}``."""
    verbosity: Any = None
    """Parsed only to be refused: no model here knows how to be terse or wordy on demand."""


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""OpenAI's ``reasoning.effort`` values (of which only ``none`` is served: no thinking budget
exists here, but a template can be told not to think)."""


class ReasoningConfig(BaseModel):
    """``reasoning``: how much a reasoning model thinks and what it shows of it. Only
    ``effort: "none"`` (do not think) is served; the rest is checked where the request is
    translated (openai_api.responses_input), so the error names the setting."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    """Deprecated spelling of ``summary``."""
    context: str | None = None
    """Which past thoughts the model sees: ``current_turn`` is what is done (past reasoning items
    are kept, never shown to the model again)."""
    mode: str | None = None


class ResponsesRequest(BaseModel):
    """A field OpenAI's Responses API does not define (``seed``, ``logit_bias``: chat's
    extensions) is a 400 naming it, as OpenAI answers; dropping it would change what was asked."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    """Required, unless ``previous_response_id`` names a stored response (its model is used)."""
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    """A system message ahead of the input; not carried on to a continuation (as OpenAI)."""
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = None
    """Default true: the response is kept (openai_api.response_store) for ``GET`` and for
    ``previous_response_id``."""
    previous_response_id: str | None = Field(default=None, max_length=128)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1, strict=True)
    """vLLM's field, as on chat: the request's place in its worker's queue, lower first."""
    # Generation-changing fields this server does not serve: refused by name, never dropped.
    background: Any = None
    include: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
    # Informational: accepted and ignored (they change no token).
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    stream_options: Any = None


REFUSED_FIELDS = ("background", "include", "truncation", "top_logprobs",
                  "max_tool_calls", "prompt", "conversation", "context_management")
"""Refused unless :func:`is_neutral` (a value that asks for nothing beyond what is served)."""


_NEUTRAL: dict[str, Any] = {"background": False, "truncation": "disabled", "top_logprobs": 0,
                            "include": []}


def is_neutral(name: str, value: Any) -> bool:
    """Whether `value` of the refused field `name` asks for nothing this server does not do."""
    if value is None:
        return True
    neutral = _NEUTRAL.get(name)
    return neutral is not None and type(value) is type(neutral) and value == neutral


# ---- the response object -----------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's thoughts (chat's ``reasoning_content``), ahead of the answer's items.
    No ``summary`` is written (no model here summarises its thoughts) and no
    ``encrypted_content`` (the thoughts are returned in the clear, as text)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ResponseStatus


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ResponseStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    """JSON text, as the model wrote it."""
    status: ResponseStatus


OutputItem = Annotated[ReasoningItem | OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """Always 0: a worker reports how many tokens it wrote, not where its thoughts ended (the
    split is made on text, which cannot be counted back into tokens exactly); the thoughts'
    tokens are in ``output_tokens``."""


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """``{"object": "response"}``: what create, retrieve and the lifecycle events carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
