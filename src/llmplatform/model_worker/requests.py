"""Checking a generation request before the worker answers it: the one place a request is
parsed and checked.

A request is accepted (:func:`accept`) only once everything it can fail before generating has
been checked, in this order: the model, its request id (reserved for it until it ends:
:class:`~.admission.Ticket`), its prompt rendered and tokenized (one thread hop; sized here with
``openai_max_tokens``), its sampling params, then the backend's admission
(:meth:`LLMBackend.check_request`: the vocabulary, the context, what the engine can run), and last
its output constraint compiled (``structured_output``: the request waits here while its grammar
compiles, off the event loop, and no other request's steps wait for it). What comes out is an
:class:`~llmplatform.llm.base.AdmittedRequest`, which the backend and the engine trust. The
worker then answers a refusal as the whole response and an accepted request with a stream whose
first chunk is output (:data:`~llmplatform.protocol.worker.ACCEPTED_HEADER`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from llmplatform.errors import InvalidRequestError, LLMPlatformError, ModelNotFoundError
from llmplatform.llm.base import AdmittedRequest, GenerateRequest, LLMBackend
from llmplatform.llm.embedding import ModelTask
from llmplatform.metrics.worker import RequestObserver, WorkerMetrics
from llmplatform.model_worker.admission import Ticket
from llmplatform.protocol.worker import WorkerParams
from llmplatform.sampling.context_length import resolve_max_new_tokens
from llmplatform.sampling.params import SamplingParams
from llmplatform.utils.logs import REQUEST_ID

logger = logging.getLogger("llmplatform.worker")

WORKER_PARAM_EXTENSIONS = ("messages", "openai_max_tokens", "logit_bias", "structured_output",
                           "stream_deltas", "cache_salt", "chat_template_kwargs")
"""The params-dict additions this worker understands beyond FastChat's (``/model_details``).
``n`` is listed by a worker whose backend samples several outputs of one prompt, ``priority``
by one whose backend queues requests by priority (the native engine; the hf backend runs each
request on its own as a slot frees, in arrival order, and refuses one).
``stream_deltas`` (delta frames, :mod:`.framing`) needs no announcing: each frame says what it
is, so a gateway may ask any worker; it is listed for operators and tests.
A gateway sends a field that changes what must be generated (``logit_bias``,
``structured_output``, ``tools``), or that keeps tenants' prefix caches apart (``cache_salt``),
only to a worker that lists it: a stock worker would drop it silently. ``tools`` is listed only by a worker whose model serves tool calls."""


def model_details_of(llm: LLMBackend) -> dict[str, Any]:
    """``/model_details``: the context length, the params additions understood and, for a model
    that serves tools, ``tool_call_parser``: the syntax its calls are written in, which the
    gateway forces (tool_choice required/named) and parses. The gateway parses, not the worker:
    it already turns the worker's text into OpenAI's shapes (n choices, deltas, logprobs), so
    the worker's stream stays FastChat's text chunks and any worker of ours serves tools."""
    params = list(WORKER_PARAM_EXTENSIONS)
    details: dict[str, Any] = {"context_length": llm.context_length, "params": params}
    if llm.parallel_sampling and ModelTask.GENERATE in llm.facts.tasks:
        params.append("n")  # one request, n outputs of one prefill
    if llm.priority_scheduling and ModelTask.GENERATE in llm.facts.tasks:
        params.append("priority")  # the engine's queues are in priority order
    if llm.tool_call_parser is not None:
        params.append("tools")
        details["tool_call_parser"] = llm.tool_call_parser
    if llm.reasoning_parser is not None:
        details["reasoning_parser"] = llm.reasoning_parser
    return details


def check_model(llm: LLMBackend, model: str | None) -> str | None:
    """Refuses a model this worker does not serve; returns the LoRA adapter ``model`` names
    (None: the base model)."""
    if model is None or model in llm.model_names:
        return None
    adapters = [adapter.name for adapter in llm.lora_adapters()]
    if model in adapters:
        return model
    raise ModelNotFoundError(f"this worker serves {list(llm.model_names) + adapters}, not {model!r}",
                             param="model")


async def render_prompt(llm: LLMBackend, params: WorkerParams) -> tuple[str, list[int], int]:
    """The prompt text, its token ids and ``max_new_tokens`` (sized here with
    ``openai_max_tokens``). One thread hop for the template and the tokenizer together: both take
    a while on long conversations."""
    budget = params.openai_max_tokens

    def render() -> tuple[str, list[int]]:
        if params.prompt is not None:
            text = params.prompt
        else:
            extra = dict(params.chat_template_kwargs or {})
            if params.tools:
                extra["tools"] = params.tools
            text = llm.apply_chat_template_sync(params.messages or [], **extra)
        return text, llm.encode_sync(text)

    if params.tools is not None:
        if llm.tool_call_parser is None:
            raise InvalidRequestError(
                f"model {llm.model_names[0]!r} is served without a tool-capable chat template; "
                "its worker needs --chat-template and --tool-call-parser for tools",
                param="tools")
        if params.messages is None:
            raise InvalidRequestError("tools need chat messages, not a prompt", param="tools")

    text, ids = await asyncio.to_thread(render)
    if budget is None:
        return text, ids, params.max_new_tokens
    max_new_tokens = resolve_max_new_tokens(budget.requested, prompt_tokens=len(ids),
                                            context_length=llm.context_length,
                                            default=budget.default, prompt_param=budget.param)
    return text, ids, max_new_tokens


def sampling_params_from(params: WorkerParams, max_new_tokens: int | None = None) -> SamplingParams:
    if params.images:
        raise InvalidRequestError("this worker serves a text-only model; images are not supported",
                                  param="images")
    if params.use_beam_search:
        raise InvalidRequestError("beam search is not supported", param="use_beam_search")
    if params.best_of is not None and params.best_of != 1:
        # Every output sampled is returned (n); never pick silently among them.
        raise InvalidRequestError("best_of other than 1 is not supported", param="best_of")
    stop = params.stop or ()
    return SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        seed=params.seed, min_tokens=params.min_tokens,
        max_tokens=params.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(params.stop_token_ids or ()), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=params.skip_special_tokens, logit_bias=params.logit_bias, n=params.n or 1)


def check_priority(llm: LLMBackend, params: WorkerParams) -> int:
    """The request's priority (0 when unset); one other than 0 is refused by a backend that
    does not schedule by priority: it would run the request in arrival order anyway."""
    priority = params.priority or 0
    if priority and not llm.priority_scheduling:
        raise InvalidRequestError(
            f"the {llm.backend_name} backend does not schedule requests by priority; send "
            "priority 0 (or none)", param="priority")
    return priority


async def compile_constraint(llm: LLMBackend, params: WorkerParams) -> Any:
    """The request's compiled output grammar (``structured_output`` set); a spec that is
    malformed, does not compile or compiles too slowly is a 400 naming the client's field."""
    assert params.structured_output is not None
    from llmplatform.sampling.structured_output import StructuredOutputSpec

    return await llm.compile_grammar(StructuredOutputSpec.from_wire(params.structured_output),
                                     tenant=params.tenant)


@dataclass
class Accepted:
    """A request the worker has checked and will generate."""

    request: AdmittedRequest
    params: WorkerParams
    prompt: str
    """The rendered prompt (what ``echo`` prepends)."""
    observer: RequestObserver


async def accept(llm: LLMBackend, params: WorkerParams, ticket: Ticket, *,
                 metrics: WorkerMetrics) -> Accepted:
    """Every check a request can fail before generating (LLMPlatformError), done before the
    worker answers; the request's id is reserved on `ticket` until the ticket is released.
    Starts the request's timing (its arrival) and its logging context."""
    request_id = params.request_id or uuid.uuid4().hex
    # Every line logged about this request carries its id (the engine's too). Set, not scoped:
    # the context is this request's own (the response's stream runs in a copy of it).
    REQUEST_ID.set(request_id)
    observer = metrics.observe_request()
    try:
        lora_name = check_model(llm, params.model)
        ticket.reserve_id(request_id)
        priority = check_priority(llm, params)
        prompt, prompt_ids, max_new_tokens = await render_prompt(llm, params)
        admitted = llm.check_request(GenerateRequest(
            request_id=request_id, params=sampling_params_from(params, max_new_tokens),
            prompt_token_ids=tuple(prompt_ids), prompt=prompt, cache_salt=params.cache_salt,
            lora_name=lora_name, priority=priority))
        if params.structured_output is not None:
            admitted = admitted.with_grammar(await compile_constraint(llm, params))
    except LLMPlatformError as exc:
        logger.info("refused: %s", exc.message)  # never handed over: the observer counts nothing
        raise
    return Accepted(admitted, params, prompt, observer)
