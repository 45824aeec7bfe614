"""Stock FastChat workers, behind one adapter: the gateway's main path speaks only to ours.

The main path has one mode. It sends every worker one request per choice (per prompt, for all
its choices, to a worker that lists ``n``) with the prompt as the client gave it (chat ``messages``, or a completion's ``prompt``) and the sizing rule
(``openai_max_tokens``), and reads delta frames (``WorkerChunk.delta``: only what is new). A
worker of ours renders, counts and sizes the prompt itself and sends delta frames when asked.

A stock FastChat worker does neither, and this module makes it look as if it did:

- :func:`for_peer` rewrites the params for a worker that lacks our additions (``messages``,
  ``openai_max_tokens`` missing from its ``/model_details``): the prompt rendered here (by the
  worker's ``/worker_apply_chat_template`` where it has one, else FastChat's conversation
  template, as FastChat's own gateway does, with the template's stop strings and ids), counted
  (``/count_token``) and sized against ``/model_details``' context length.
- :class:`CumulativeFrames` turns its cumulative frames (every frame all the text and logprob
  entries so far) into delta frames, holding back a trailing half UTF-8 character (U+FFFD, which
  the next cumulative frame replaces by the whole character) and the logprob entries of tokens
  that start inside it. Our worker sends cumulative frames too when the gateway does not ask for
  deltas (``--no-worker-stream-deltas``); they take the same road.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmplatform.conversation import render_chat_prompt
from llmplatform.openai_api.deltas import REPLACEMENT_CHAR, slice_logprobs
from llmplatform.openai_api.translate import merge_stops
from llmplatform.protocol.worker import OpenAIMaxTokens, WorkerChunk
from llmplatform.sampling.context_length import resolve_max_new_tokens

if TYPE_CHECKING:
    from llmplatform.openai_api.worker_client import WorkerClient

SINGLE_CALL = frozenset({"messages", "openai_max_tokens"})
"""The params additions that let a worker take the main path's request as it is."""


async def for_peer(client: WorkerClient, address: str, model: str,
                   params: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``params`` (the choices of one prompt, as the main path built them) as the worker at
    ``address`` takes them, and the prompt's token count when the gateway had to count it (0:
    the worker counts, and reports it in every chunk's usage)."""
    if SINGLE_CALL <= (await client.model_details(address, model)).extensions:
        return list(params), 0
    first = params[0]
    budget = OpenAIMaxTokens.model_validate(first["openai_max_tokens"])
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    if first.get("messages") is not None:
        rendered = await client.apply_chat_template(address, model, first["messages"])
        if rendered is not None:  # a worker of ours without the single-call additions
            prompt, prompt_tokens, context_length = rendered
        else:  # a stock FastChat worker: its conversation template, rendered here
            conv = await client.conv_template(address, model)
            prompt = render_chat_prompt(conv, first["messages"])
            stop, stop_token_ids = tuple(conv.stop_strings), tuple(conv.stop_token_ids)
            prompt_tokens, context_length = await asyncio.gather(
                client.count_tokens(address, model, prompt), client.context_length(address, model))
    else:
        prompt = first["prompt"]
        prompt_tokens, context_length = await asyncio.gather(
            client.count_tokens(address, model, prompt), client.context_length(address, model))
    max_new_tokens = resolve_max_new_tokens(budget.requested, prompt_tokens=prompt_tokens,
                                            context_length=context_length, default=budget.default,
                                            prompt_param=budget.param)
    return [_stock(p, prompt, max_new_tokens, stop, stop_token_ids) for p in params], prompt_tokens


def _stock(params: Mapping[str, Any], prompt: str, max_new_tokens: int, stop: Sequence[str],
           stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """One choice's params in FastChat's form: the rendered prompt, sized, with the template's
    stops added (without duplicates, the request's first)."""
    stock = {key: value for key, value in params.items()
             if key not in ("messages", "openai_max_tokens")}
    stock.update(prompt=prompt, max_new_tokens=max_new_tokens)
    stops = merge_stops(params.get("stop"), stop)
    if stops:
        stock["stop"] = stops
    ids = list(dict.fromkeys([*(params.get("stop_token_ids") or []), *stop_token_ids]))
    if ids:
        stock["stop_token_ids"] = ids
    return stock


class CumulativeFrames:
    """One choice's cumulative frames as delta frames (what the main path reads)."""

    def __init__(self) -> None:
        self._num_chars_sent = 0
        self._num_tokens_sent = 0

    def delta(self, chunk: WorkerChunk) -> WorkerChunk:
        """The delta frame that carries what ``chunk`` adds to what was passed on so far."""
        assert not chunk.delta
        final = chunk.finish_reason is not None
        text = chunk.text
        end = len(text) if final else len(text.rstrip(REPLACEMENT_CHAR))
        delta_text = text[self._num_chars_sent:end] if end > self._num_chars_sent else ""
        self._num_chars_sent = max(self._num_chars_sent, end)
        logprobs = chunk.logprobs
        if logprobs is not None:
            num_ready = len(logprobs.tokens)
            if not final and len(logprobs.text_offset) == num_ready:
                # Tokens that start inside the held-back tail wait for it.
                num_ready = self._num_tokens_sent
                while num_ready < len(logprobs.tokens) and logprobs.text_offset[num_ready] < end:
                    num_ready += 1
            lo, hi = self._num_tokens_sent, max(self._num_tokens_sent, num_ready)
            self._num_tokens_sent = hi
            logprobs = slice_logprobs(logprobs, lo, hi)
        return chunk.model_copy(update={"text": delta_text, "logprobs": logprobs, "delta": True})
