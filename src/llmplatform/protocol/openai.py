"""OpenAI's HTTP API as the gateway speaks it: request and response models (contracts only).

Requests are parsed strictly from JSON (a string is not a number, 1 is not a boolean), ignore
unknown fields (clients send many we do not use), and accept ``null`` wherever OpenAI does, which
means "the default". Range limits live in the field definitions so that a violation names the
field. Fields marked *extension* are not OpenAI's; vLLM and FastChat accept the same names.

Responses carry the fields OpenAI sends, ``null`` included; a chat delta carries only what
changed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

# ---- requests -------------------------------------------------------------------------------------


_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_INT32_MAX = 2**31 - 1
# Token ids and top_k travel on to tensors: bounded here so a huge integer is a 400, not an
# overflow inside the engine.
TokenId = Annotated[int, Field(ge=0, le=_INT32_MAX)]
# logit_bias values: OpenAI's range; -100 effectively bans a token, +100 effectively forces it.
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class ContentPart(BaseModel):
    """One part of a message's content list; only ``{"type": "text"}`` parts are served."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(_Request):
    """A function call in an assistant message (history) or a reply."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    """system, developer (treated as system), user, assistant or tool."""
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant messages: the calls the model made."""
    tool_call_id: str | None = None
    """Tool messages: the call this is the result of."""


class _SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="Default 1.0.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Default 1.0.")
    n: int | None = Field(
        default=None, ge=1, le=128, description="Choices per prompt; default 1. OpenAI's ceiling; the "
        "gateway's --max-n is usually lower.",
    )
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_UINT64_MAX)
    user: str | None = None
    logit_bias: dict[str, LogitBias] | None = Field(
        default=None, description="Token id (a decimal string) -> bias added to its logit. Checked "
        "against the model's vocabulary by the worker; sent only to a worker that announced it.")
    # ---- extensions ----
    top_k: int | None = Field(default=None, ge=-1, le=_INT32_MAX, description="-1 or 0: off.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256, description="vLLM's field: only requests with "
        "the same salt share cached prompt prefixes on a worker (the gateway may add its key's "
        "id, --prefix-cache-isolation); refused for a worker that cannot honour it.")
    priority: int | None = Field(
        default=None, ge=-_INT32_MAX - 1, le=_INT32_MAX, strict=True, description="vLLM's field: "
        "the request's place in its worker's queue, lower first; default 0. Refused (unless 0) for "
        "a worker that does not schedule by priority.")
    # vLLM's token lists, parsed only to be refused (translate.check_unsupported): dropping them
    # silently would generate tokens the client banned or did not allow.
    allowed_token_ids: Any = None
    bad_words: Any = None
    # Output constraints, validated into one grammar by openai_api.constraints (OpenAI's
    # response_format; vLLM's guided_* extras and structured_outputs object).
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # Not served: parsed only to be refused by name (translate.check_unsupported) rather than
    # silently ignored.
    logits_processors: Any = None
    use_beam_search: Any = None
    include_stop_str_in_output: Any = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Takes precedence over max_tokens."
    )
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Parsed only to be refused: the prompt is always rendered with the worker's own template. A
    # request-supplied Jinja template would run client code in the worker's template engine.
    chat_template: Any = None
    chat_template_kwargs: Any = None
    # Function tools, validated by openai_api.constraints (openai_api.tools).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # The legacy function-calling fields are not served: refused by name.
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None


class CompletionRequest(_SamplingRequest):
    # Token-id prompts parse (so the error can say "not supported" rather than "wrong type").
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``. ``input``: a string, strings, token ids or lists of them (each
    list one input, taken as the model's whole input); at most ``MAX_EMBEDDING_INPUTS``."""

    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    """Accepted and ignored, as by OpenAI's server for anything but abuse monitoring."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """*extension* (vLLM's name): cut longer inputs to this many tokens (-1: the model's limit)
    instead of refusing them with ``context_length_exceeded``."""


# ---- responses ------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None
    """A reasoning model's thoughts (the worker's --reasoning-parser), apart from ``content``;
    also sent as ``reasoning``, the name newer vLLM uses. Absent when there were none."""

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return _with_reasoning(data)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Only the fields that changed; the final chunk of a choice has an empty delta `{}`."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """OpenAI's fragments: ``index``, then ``id``, ``type`` and ``function.name`` once per call,
    ``function.arguments`` in pieces (``ToolCallDelta.to_openai``)."""

    reasoning_content: str | None = None
    """A piece of a reasoning model's thoughts (also sent as ``reasoning``, as newer vLLM)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _with_reasoning({key: value for key, value in handler(self).items()
                                if value is not None})


def _with_reasoning(data: dict[str, Any]) -> dict[str, Any]:
    """``reasoning_content`` under both names when present (vLLM's old and new), else neither."""
    if data.get("reasoning_content") is None:
        data.pop("reasoning_content", None)
    else:
        data["reasoning"] = data["reasoning_content"]
    return data


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# A streamed text completion chunk has the same shape as the full response.
CompletionChunk = CompletionResponse


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmplatform"
    tasks: list[str] | None = None
    """*extension*: what the model serves, ``generate`` (chat, completions) and/or ``embed``
    (embeddings); None when its workers do not say (stock FastChat ones)."""
    loaded: bool = True
    """*extension*: False for a model launchable on demand that no worker runs yet (the first
    request for it starts one)."""
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's field); None for a base model."""
    root: str | None = None
    """A LoRA adapter's path (vLLM's field); None for a base model."""


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail

    @classmethod
    def of(cls, message: str, type: str, param: str | None = None, code: Any = None) -> ErrorResponse:
        return cls(error=ErrorDetail(message=message, type=type, param=param, code=code))
