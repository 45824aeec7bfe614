"""OpenAI requests -> worker params dicts: pure functions, no I/O.

The route handlers call these in order: check the request's own consistency
(:func:`chat_messages`, :func:`check_chat_request`, :func:`completion_prompts`), then, once a
worker is chosen, whether it understands every field the request needs
(:func:`check_worker_extensions`), then one params object per choice (:func:`worker_params`):
the worker sizes the completion (``openai_max_tokens``), or fastchat_peer.py does for a stock one.

Token ids (``stop_token_ids``, ``logit_bias`` keys) are checked here only for their shape: the
worker, which knows the model's vocabulary, checks their range and refuses naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.constraints import WorkerConstraint
from llmplatform.openai_api.settings import RequestLimits
from llmplatform.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from llmplatform.protocol.worker import RESERVED_TEMPLATE_KWARGS, OpenAIMaxTokens, WorkerParams
from llmplatform.sampling.params import MAX_LOGIT_BIAS_ENTRIES, MAX_SEED

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` for /v1/completions."""

_ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool"}


def new_id(prefix: str) -> str:
    """`chatcmpl-<32 hex>`, `cmpl-<32 hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- request checks -------------------------------------------------------------------------------


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as `[{"role", "content": str}]`, the shape chat templates take.

    `developer` becomes `system`; a content list must hold only text parts, which are joined with
    newlines (as FastChat and vLLM do). Only an assistant message may have no content. An
    assistant message keeps its `tool_calls` and a `tool` message its `tool_call_id`: the
    model's template renders them (a worker that announced `tools` only).
    """
    normalized: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = _ROLE_ALIASES.get(message.role)
        if role is None:
            raise InvalidRequestError(
                f"Invalid value for 'messages[{index}].role': {message.role!r} is not supported; "
                "use 'system', 'developer', 'user', 'assistant' or 'tool'.",
                param=f"messages[{index}].role",
            )
        content = message.content
        if content is None:
            if role != "assistant":
                raise InvalidRequestError(
                    f"Missing required parameter: 'messages[{index}].content'.",
                    param=f"messages[{index}].content",
                )
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            texts = []
            for part_index, part in enumerate(content):
                where = f"messages[{index}].content[{part_index}]"
                if part.type != "text":
                    raise InvalidRequestError(
                        f"Invalid value for '{where}.type': content of type {part.type!r} is not "
                        "supported; this server accepts text only.",
                        param=f"{where}.type",
                    )
                if part.text is None:
                    raise InvalidRequestError(f"Missing required parameter: '{where}.text'.", param=f"{where}.text")
                texts.append(part.text)
            text = "\n".join(texts)
        entry: dict[str, Any] = {"role": role, "content": text}
        if message.tool_calls:
            if role != "assistant":
                raise InvalidRequestError(
                    f"Invalid value for 'messages[{index}].tool_calls': only assistant messages "
                    "carry tool calls.", param=f"messages[{index}].tool_calls")
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if role == "tool":
            if message.tool_call_id is None:
                raise InvalidRequestError(
                    f"Missing required parameter: 'messages[{index}].tool_call_id'.",
                    param=f"messages[{index}].tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
        normalized.append(entry)
    return normalized


_UNSUPPORTED = ("allowed_token_ids", "bad_words", "logits_processors", "use_beam_search",
                "include_stop_str_in_output", "functions", "function_call", "modalities", "audio")
"""Not served (tools and output constraints are: openai_api.constraints)."""


def _is_neutral(name: str, value: Any) -> bool:
    """The values of an unsupported field that ask for nothing beyond plain text generation."""
    if name == "functions":
        return value == []
    if name == "function_call":
        return value == "none"
    if name in ("use_beam_search", "include_stop_str_in_output"):
        return value is False
    if name == "modalities":
        return value == ["text"]
    return False


def check_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields a client may send that this server does not serve: refused, never dropped (each
    would change which tokens may be generated)."""
    for name in _UNSUPPORTED:
        value = getattr(request, name, None)
        if value is not None and not _is_neutral(name, value):
            raise InvalidRequestError(f"Invalid value for '{name}': {name} is not supported.", param=name)
    bias = request.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"Invalid value for 'logit_bias': {len(bias)} entries are more than this server's limit "
            f"of {MAX_LOGIT_BIAS_ENTRIES}.", param="logit_bias")
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidRequestError(
                f"Invalid value for 'logit_bias': keys must be token ids (non-negative integers), "
                f"got {key[:40]!r}.", param="logit_bias")


def required_extensions(request: ChatCompletionRequest | CompletionRequest) -> frozenset[str]:
    """The params-dict additions a worker must understand to serve this request as asked (a
    client's ``cache_salt``: a worker that drops it shares its prefix cache anyway)."""
    names = set()
    if request.logit_bias:
        names.add("logit_bias")
    if request.cache_salt is not None:
        names.add("cache_salt")
    if request.priority:  # 0 is every request's priority: it asks for nothing a worker may drop
        names.add("priority")
    if getattr(request, "chat_template_kwargs", None):
        names.add("chat_template_kwargs")
    return frozenset(names)


def check_worker_extensions(request: ChatCompletionRequest | CompletionRequest,
                            announced: frozenset[str]) -> None:
    """Refuse a request whose generation-changing fields the chosen worker did not announce
    (``/model_details`` ``params``): a stock worker would ignore them and generate anyway."""
    missing = sorted(required_extensions(request) - announced)
    if missing:
        raise InvalidRequestError(
            f"Invalid value for '{missing[0]}': the worker serving model {request.model!r} does "
            f"not support {missing[0]}.", param=missing[0])


def check_chat_request(request: ChatCompletionRequest) -> None:
    if request.chat_template is not None:
        raise InvalidRequestError(
            "Invalid value for 'chat_template': a request may not supply a chat template; "
            "prompts are rendered with the model's own template.", param="chat_template")
    kwargs = request.chat_template_kwargs
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise InvalidRequestError("Invalid value for 'chat_template_kwargs': it must be an "
                                      "object of template variables.", param="chat_template_kwargs")
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(
                f"Invalid value for 'chat_template_kwargs': {reserved[0]!r} is not a template "
                "variable a request may set.", param="chat_template_kwargs")
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequestError(
            "Invalid value for 'top_logprobs': 'logprobs' must be set to true when "
            "'top_logprobs' is used.",
            param="top_logprobs",
        )


def completion_prompts(request: CompletionRequest) -> list[str]:
    """The request's prompts (one string or several), after the completion-only checks."""
    if request.suffix:
        raise InvalidRequestError("Invalid value for 'suffix': suffix is not supported.", param="suffix")
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        raise InvalidRequestError(
            "Invalid value for 'best_of': only best_of equal to n is supported.", param="best_of"
        )
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("Invalid value for 'prompt': the prompt list is empty.", param="prompt")
    prompts = [p for p in prompt if isinstance(p, str)]
    if len(prompts) != len(prompt):
        raise InvalidRequestError(
            "Invalid value for 'prompt': token-id prompts are not supported; send text.",
            param="prompt",
        )
    return prompts


def check_limits(
    request: ChatCompletionRequest | CompletionRequest, limits: RequestLimits, *, num_prompts: int = 1
) -> None:
    """The request against the gateway's caps: each bounds the work one request can create."""
    n = request.n or 1
    if n > limits.max_n:
        raise InvalidRequestError(
            f"Invalid value for 'n': {n} is more than this server's limit of {limits.max_n}.", param="n"
        )
    if n * num_prompts > limits.max_n:
        raise InvalidRequestError(
            f"Invalid value for 'prompt': {num_prompts} prompts with n={n} make {n * num_prompts} "
            f"choices, more than this server's limit of {limits.max_n}.",
            param="prompt",
        )
    name, alternatives = (
        ("top_logprobs", request.top_logprobs)
        if isinstance(request, ChatCompletionRequest)
        else ("logprobs", request.logprobs)
    )
    if alternatives is not None and alternatives > limits.max_logprobs:
        raise InvalidRequestError(
            f"Invalid value for '{name}': {alternatives} is more than this server's limit of "
            f"{limits.max_logprobs}.",
            param=name,
        )
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"Invalid value for 'stop': {len(stops)} stop sequences are more than this server's "
            f"limit of {limits.max_stop_sequences}.",
            param="stop",
        )
    for stop in stops:
        if not stop:
            raise InvalidRequestError("Invalid value for 'stop': stop sequences must not be empty.", param="stop")
        if len(stop) > limits.max_stop_length:
            raise InvalidRequestError(
                f"Invalid value for 'stop': a stop sequence of {len(stop)} characters is longer than "
                f"this server's limit of {limits.max_stop_length}.",
                param="stop",
            )


# ---- params --------------------------------------------------------------------------------------


def merge_stops(requested: str | list[str] | None, extra: Iterable[str] = ()) -> list[str] | None:
    """The request's stop strings plus `extra`, without duplicates or empty strings."""
    stops = [requested] if isinstance(requested, str) else list(requested or [])
    merged: list[str] = []
    for stop in [*stops, *extra]:
        if stop and stop not in merged:
            merged.append(stop)
    return merged or None


def worker_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    budget: OpenAIMaxTokens,
    request_id: str,
    choice_index: int,
    constraint: WorkerConstraint | None = None,
    cache_salt: str | None = None,
    tenant: str | None = None,
) -> WorkerParams:
    """The worker params of one choice of a chat (``messages``) or a text completion (``prompt``)
    request, as a worker of ours takes them: it renders, counts and sizes the prompt itself
    (``budget``); fastchat_peer.py rewrites them for a stock worker."""
    top_k = request.top_k if request.top_k not in (None, 0) else -1
    stop_token_ids = list(dict.fromkeys(request.stop_token_ids or []))
    return WorkerParams(
        model=request.model,
        prompt=prompt,
        messages=messages,
        openai_max_tokens=budget,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=top_k,
        min_p=request.min_p or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        # Ignored by a worker that sizes the request (budget); only what a reader would expect.
        max_new_tokens=budget.requested or budget.default or 256,
        stop=merge_stops(request.stop),
        stop_token_ids=stop_token_ids or None,
        ignore_eos=bool(request.ignore_eos),
        min_tokens=request.min_tokens or 0,
        # Each choice samples on its own; with a seed, choice i uses seed + i so they differ
        # (modulo 2**64, as generators take seeds: the sum stays in the range workers accept).
        seed=None if request.seed is None else _wrap_seed(request.seed + choice_index),
        logit_bias=request.logit_bias or None,
        request_id=request_id,
        structured_output=constraint.structured_output if constraint is not None else None,
        tools=constraint.tools if constraint is not None else None,
        cache_salt=cache_salt,
        priority=request.priority or None,
        tenant=tenant,
        chat_template_kwargs=getattr(request, "chat_template_kwargs", None) or None,
        **_returned_extras(request),
    )


def _returned_extras(request: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """What each endpoint asks back besides the text: chat, the chosen tokens' logprobs
    (`logprobs`) with `top_logprobs` alternatives; a completion, `logprobs` alternatives and,
    with `echo`, the prompt and its logprobs."""
    if isinstance(request, ChatCompletionRequest):
        return {"echo": False, "logprobs": (request.top_logprobs or 0) if request.logprobs else None}
    echo = bool(request.echo)
    prompt_logprobs = request.logprobs if (echo and request.logprobs is not None) else None
    return {"echo": echo, "logprobs": request.logprobs, "prompt_logprobs": prompt_logprobs}


def _wrap_seed(seed: int) -> int:
    return seed - 2**64 if seed > MAX_SEED else seed


def choice_params(n: int, announced: frozenset[str],
                  params_of: Callable[[int], dict[str, object]]) -> list[dict[str, object]]:
    """The worker requests for one prompt's `n` choices, given `params_of(i)`, choice i's params:
    one request for all n to a worker that lists ``n`` (it computes the prompt once and forks
    its blocks), one per choice otherwise. Either way output i is seeded seed + i."""
    if n > 1 and "n" in announced:
        return [{**params_of(0), "n": n}]
    return [params_of(i) for i in range(n)]


def params_dict(params: WorkerParams) -> dict[str, object]:
    """The wire form: unset optional fields left out, `echo` always present (a stock worker
    treats a missing `echo` as true)."""
    data = params.model_dump(exclude_none=True)
    data["echo"] = params.echo
    return data
