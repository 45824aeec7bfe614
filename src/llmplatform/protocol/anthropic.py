"""Anthropic's Messages API as the gateway speaks it (``/v1/messages``): request, response, stream
event and error models (contracts only).

Requests parse strictly (a string is not a number). A field Anthropic does not define is refused
by name (``seed``, ``logit_bias``: OpenAI's extensions have no meaning here, and dropping one
would change what the client asked for), as Anthropic refuses it; the informational fields it
defines (``service_tier`` ...) are declared and ignored. Content blocks parse loosely (``type`` plus whatever a block of that type carries) so that a
block the gateway does not serve (an image, a document) is refused by name by the translation
(``openai_api.messages_translate``) rather than with a schema error. Fields that would change the
generation and are not served are parsed only to be refused by name.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# ---- requests -------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class RequestBlock(BaseModel):
    """One content block of a request message (or of a ``tool_result``'s content): ``text``,
    ``tool_use``, ``tool_result`` are served; any other ``type`` is refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None
    """``text``."""
    id: str | None = None
    """``tool_use``: the call's id."""
    name: str | None = None
    """``tool_use``: the tool called."""
    input: dict[str, Any] | None = None
    """``tool_use``: the call's arguments."""
    tool_use_id: str | None = None
    """``tool_result``: the call this answers."""
    content: str | list[RequestBlock] | None = None
    """``tool_result``: the result, a string or text blocks."""
    is_error: bool | None = None
    """``tool_result``: the call failed."""


class MessageParam(_Request):
    role: str
    """``user`` or ``assistant``."""
    content: str | list[RequestBlock]


class ToolParam(BaseModel):
    """A client tool (``type`` absent or ``custom``); Anthropic's server tools (``web_search_...``,
    ``bash_...``) are refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceParam(_Request):
    type: str
    """``auto``, ``any``, ``tool`` (with ``name``) or ``none``."""
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Request):
    user_id: str | None = None
    """Not sent to the model; the gateway uses it as the session key (routing affinity), as it
    does OpenAI's ``user``."""


class _MessagesBase(_Request):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: what makes the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[RequestBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: Any = None
    """``{"type": "disabled" | "adaptive" | "enabled", ...}``: read by
    ``messages_translate.thinking_of`` (refused by name where it cannot be honoured)."""
    # Not served: parsed only to be refused by name (messages_translate.check_unserved).
    output_config: Any = None
    output_format: Any = None
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None
    # Informational: accepted and ignored (they change no token).
    service_tier: Any = None
    cache_control: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None


class MessagesRequest(_MessagesBase):
    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0, description="Default 1.0.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1, description="0: off.")
    metadata: Metadata | None = None


class CountTokensRequest(_MessagesBase):
    """``/v1/messages/count_tokens``: the prompt of a Messages request, nothing about its output."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---- responses ------------------------------------------------------------------------------------


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """A reasoning model's thoughts, ahead of the answer's blocks."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""
    """Anthropic's proves the thoughts came from its model; this server signs nothing (always
    ``""``), and drops thinking blocks sent back, so no client can mistake it for a proof."""


ContentBlock = Union[ThinkingBlock, TextBlock, ToolUseBlock]

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    """``msg_<hex>``."""
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- stream events (each sent as ``event: <type>`` + ``data: <json>``) ----------------------------


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse
    """Empty ``content``, no ``stop_reason`` yet; ``usage.input_tokens`` is the prompt's."""


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock
    """Empty: ``thinking`` "" (and ``signature`` ""), ``text`` "" or ``tool_use`` with ``input``
    {} (its JSON follows in deltas)."""


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    """The thinking block's signature, just before its ``content_block_stop``."""

    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Union[ThinkingDelta, SignatureDelta, TextDelta, InputJsonDelta]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class MessageDelta(BaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# ---- errors ---------------------------------------------------------------------------------------

ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                    "timeout_error", "overloaded_error"]


class ErrorDetail(BaseModel):
    type: ErrorType
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's envelope, as a body and as the ``error`` stream event."""

    type: Literal["error"] = "error"
    error: ErrorDetail
