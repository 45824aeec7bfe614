"""Messages between the gateway (or a controller) and a model worker: FastChat's wire format.

The params dict is parsed once, at the worker's edge, into :class:`WorkerParams`; unknown fields
are ignored (a newer peer may send more), known ones are strict about their JSON types (a string
is not a number: a client mistake is refused naming the field, never coerced or a 500). Ranges
are checked when the params become ``SamplingParams``, and what depends on the model (token ids
against the vocabulary, the context) when the backend admits the request
(``LLMBackend.check_request``), before the worker answers. Stream chunks are
:class:`WorkerChunk` objects, each serialised as JSON followed by one NUL byte. ``text`` is cumulative (all text so far), not a delta,
unless the request asked for delta frames (``stream_deltas``, our addition) and the chunk says it
is one (``delta``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator,
                      model_validator)

NUL = b"\0"

MAX_REQUEST_ID_LENGTH = 256
"""Longest ``request_id`` a worker takes (it is logged and keys the request for aborts). The
gateway's own ids (a client's ``X-Request-Id`` of up to 128 characters, an infix and the choice
index) stay well under it."""
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_LENGTH}}}")

MAX_CACHE_SALT_LENGTH = 512
"""Longest ``cache_salt`` a worker takes (characters). The gateway's own (its key id and the
client's salt of up to 256 characters) stays under it."""

MAX_PRIORITY = 2**31 - 1
"""The largest ``priority`` a worker takes (its least urgent); the smallest is ``-MAX_PRIORITY - 1``:
a 32-bit signed integer, which every peer reads exactly."""

BACKGROUND_PRIORITY = 2**30
"""Our addition to ``priority``: a request at this priority or worse is *background* work (the
gateway's batches): a native worker runs it only on the capacity its other requests leave idle,
and preempts it to make room for them (engine.priority, "Background requests"). The gateway keeps
interactive requests' priorities below it."""

ACCEPTED_HEADER = "x-llmplatform-accepted"
"""Our addition, on a ``/worker_generate_stream`` answer: the worker checked the whole request
(model, prompt, context room, sampling) before answering, so the stream's first chunk is output,
not a refusal; only a failure of the worker itself can still end it without output. A gateway
may answer its client as soon as it sees it (headers during the prefill, not with the first
token). Our workers send it on every stream; stock workers never do: their refusals come as the
first chunk."""


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_tensors", "return_dict",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})
"""Names of ``apply_chat_template``'s own parameters: ``chat_template_kwargs`` holds template
variables only (a client choosing the template, or tokenizing, is not a variable)."""


class OpenAIMaxTokens(BaseModel):
    """Our addition: size the completion by OpenAI's rules once the worker has counted the prompt
    (so the gateway needs no /count_token or /worker_apply_chat_template round trip first).

    ``requested`` is the client's max_tokens (None: not given); ``default`` what "not given"
    means (None: all the room the context leaves); ``param`` names the prompt in errors. When
    present, ``max_new_tokens`` is ignored.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    requested: int | None = Field(default=None, ge=1)
    default: int | None = Field(default=None, ge=1)
    param: Literal["messages", "prompt"] = "prompt"


class WorkerParams(BaseModel):
    """The params dict of /worker_generate_stream and /worker_generate.

    Defaults are FastChat's: a stock worker treats a missing ``echo`` as true and a missing
    ``max_new_tokens`` as 256. Everything after ``use_beam_search`` is our addition.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    """Required unless ``messages`` is given (a stock worker always needs it)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    echo: StrictBool = True
    logprobs: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    images: list[Any] | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None
    # ---- our additions ----
    request_id: str | None = None
    seed: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    """Chat messages the worker renders with its model's own chat template (instead of ``prompt``,
    which then must be absent): one round trip where a stock worker needs two."""
    openai_max_tokens: OpenAIMaxTokens | None = None
    logit_bias: dict[str, float] | None = None
    """OpenAI's map of token id (a decimal string, as JSON keys are) -> bias in [-100, 100]. It
    changes what must be generated: a gateway sends it only to a worker that lists it in
    ``/model_details`` ``params``."""
    structured_output: dict[str, Any] | None = None
    """The output's constraint (``StructuredOutputSpec.to_wire``: ``type``, ``source``,
    ``strict``, ``param``), enforced token by token; sent only to a worker that lists it."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools, for the chat template to show the model (with ``messages`` only);
    sent only to a worker that lists it. Whether a call is forced travels in
    ``structured_output``."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's field: extra variables for the chat template (``enable_thinking``...), with
    ``messages`` only; names the template call itself takes are refused."""
    tenant: str | None = Field(default=None, max_length=64)
    """Who the request is for (the gateway's id of the caller's API key, never the key): a
    worker shares what one tenant could monopolise (the grammar compile slots) fairly among
    tenants. Informational for a stock worker."""
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_LENGTH)
    """vLLM's field: only requests with the same salt share prefix-cache blocks (the salt seeds
    the first block's hash, engine.prefix_cache), so one tenant's cached prefix is never a hit,
    and a timing oracle, for another. Sent only to a worker that lists it: a stock worker would
    drop it and share its cache anyway."""
    priority: StrictInt | None = Field(default=None, ge=-MAX_PRIORITY - 1, le=MAX_PRIORITY)
    """vLLM's field: the request's place in the engine's queues, lower first (None: 0, every
    request's default). It orders the waiting requests and picks who is preempted when the KV
    cache runs out (the worst priority's newest); it never preempts a running request for a
    waiting one, but for background ones (``BACKGROUND_PRIORITY`` or worse), which also run only
    on idle capacity. Sent only to a worker that lists it: a stock worker would drop it."""
    n: int | None = Field(default=None, ge=1)
    """Outputs to sample from the one prompt (OpenAI's ``n``): the worker computes the prompt once
    and forks its KV blocks, and each frame carries its output's ``index``. Sent only to a worker
    that lists ``n`` (a stock worker would sample one); streamed only."""
    stream_deltas: StrictBool = False
    """Stream delta frames: each chunk of ``/worker_generate_stream`` carries only the text and
    logprob entries that are new since the previous one (``WorkerChunk.delta`` set), so a long
    stream costs both ends the same per token throughout. A stock worker ignores it and keeps
    sending cumulative chunks, which the gateway tells apart by the missing ``delta``."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_variables(value)

    @field_validator("request_id")
    @classmethod
    def _request_id_shape(cls, value: str | None) -> str | None:
        # It is logged on every line about the request and names it for /worker_abort.
        if value is not None and not _REQUEST_ID.fullmatch(value):
            raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID_LENGTH} characters from "
                             "letters, digits and ._:-")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> "WorkerParams":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' is required")
        return self

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_bool(cls, value: Any) -> Any:
        # FastChat's chat path sends a boolean; True means "the sampled token's logprob".
        if value is True:
            return 0
        if value is False:
            return None
        return value


class ChunkUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChunkLogprobs(BaseModel):
    """FastChat's logprobs shape (cumulative, like ``text``): parallel lists per token."""

    text_offset: list[int] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class WorkerChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str = ""
    error_code: int = 0
    usage: ChunkUsage | None = None
    finish_reason: str | None = None
    logprobs: ChunkLogprobs | None = None
    param: str | None = None
    """Our addition, on an error object only: the request field the error is about."""
    index: int = 0
    """Our addition: which of the request's ``n`` outputs this frame belongs to (sent when not 0)."""
    delta: bool = False
    """Our addition: ``text`` and ``logprobs`` hold only what is new since the previous chunk
    (``logprobs.text_offset`` still counts from the start of the whole text); ``usage`` and
    ``finish_reason`` are as in a cumulative chunk. Sent only to a request with
    ``stream_deltas``."""
    stop_str: str | None = None
    """Our addition, on the final chunk of an output a stop string ended: which one (the text
    leaves it out, so only this tells it from EOS). Sent only when set; a stock worker never
    sends it."""

    def encode(self) -> bytes:
        exclude = set()
        if self.param is None:
            exclude.add("param")
        if self.stop_str is None:
            exclude.add("stop_str")
        if not self.index:
            exclude.add("index")
        if not self.delta:  # a cumulative chunk is exactly FastChat's
            exclude.add("delta")
        return self.model_dump_json(exclude_none=False, exclude=exclude or None).encode() + NUL


def error_chunk(message: str, error_code: int, param: str | None = None) -> bytes:
    """A FastChat error object: it travels inside the stream, with HTTP 200. ``param`` (our
    addition, a stock peer ignores it) names the request field at fault, so a gateway can put
    it in OpenAI's error envelope."""
    error: dict[str, Any] = {"text": message, "error_code": error_code}
    if param is not None:
        error["param"] = param
    return json.dumps(error).encode() + NUL


class CountTokenRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str


class ModelDetailsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str


def _template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}")
    return value


class ApplyChatTemplateRequest(BaseModel):
    """Our addition: render messages with the worker's own chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools for the template, as in ``WorkerParams.tools``: the prompt (and its
    count) is then the one a generation with these tools computes."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra template variables, as in ``WorkerParams.chat_template_kwargs``."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_variables(value)


class ApplyChatTemplateResponse(BaseModel):
    prompt: str
    prompt_tokens: int
    context_length: int


MAX_EMBEDDING_INPUTS = 2048
"""Inputs one embeddings request may carry (OpenAI's own limit), at the gateway and the worker."""


class WorkerEmbeddingsRequest(BaseModel):
    """Body of ``/worker_get_embeddings``. FastChat's gateway sends ``model``, ``input`` (a list
    of strings) and ``encoding_format`` (null or ``"base64"``: float32 bytes per vector); the
    answer is ``{"embedding": [vector or base64 string, ...], "token_num": total}``, or an error
    object with HTTP 200. Everything after ``encoding_format`` is our addition."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[list[StrictInt]]
    """Texts, or token id lists taken as the model's whole input (special tokens included)."""
    encoding_format: Literal["float", "base64"] | None = None
    # ---- our additions ----
    dimensions: StrictInt | None = None
    """Truncate each vector to this width (Matryoshka models only: ``/model_details``)."""
    truncate_prompt_tokens: StrictInt | None = None
    """Cut longer inputs to this many tokens (-1: the model's limit) instead of refusing them."""
    request_id: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("must hold at least one input")
            if len(value) > MAX_EMBEDDING_INPUTS:
                raise ValueError(f"must hold at most {MAX_EMBEDDING_INPUTS} inputs, not {len(value)}")
        return value


MAX_SCORE_PAIRS = 1024
"""Pairs one rerank or score request may carry (its documents, or its ``text_2`` entries), at the
gateway and the worker."""


class WorkerScoreRequest(BaseModel):
    """Body of ``/worker_score`` (ours: a worker whose ``/model_details`` lists the ``score`` or
    ``embed`` task). ``text_1[i]`` is scored against ``text_2[i]``: the gateway expands one query
    against many documents into pairs. The answer is ``{"scores": [float, ...], "token_num": N,
    "scoring": "cross-encoder" | "cosine"}`` (``cosine``: an embedding model's vectors), or an
    error object with HTTP 200, as for embeddings; an error's ``param`` is ``text_1``, ``text_2``
    or ``truncate_prompt_tokens``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    text_1: list[str]
    text_2: list[str]
    truncate_prompt_tokens: StrictInt | None = None
    """Cut longer pairs (a cross-encoder) or texts (an embedding model) to this many tokens (-1:
    the model's limit) instead of refusing them."""
    request_id: str | None = None

    @model_validator(mode="after")
    def _pairs(self) -> "WorkerScoreRequest":
        if not self.text_2:
            raise ValueError("text_2 must hold at least one text")
        if len(self.text_1) != len(self.text_2):
            raise ValueError(f"text_1 and text_2 must be as long as each other (pairs), not "
                             f"{len(self.text_1)} and {len(self.text_2)}")
        if len(self.text_2) > MAX_SCORE_PAIRS:
            raise ValueError(f"at most {MAX_SCORE_PAIRS} pairs, not {len(self.text_2)}")
        return self
