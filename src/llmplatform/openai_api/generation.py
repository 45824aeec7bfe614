"""The one path both generation routes take from a checked request to its answer.

Chat (chat.py) and text completions (completions.py) differ in what they check, how they start
their choices on a worker (``start_on``: prepare the prompt there, build one worker params dict
per choice, open the streams; run again on another worker by failover) and how worker chunks
become their answer (a :class:`Reply`). The rest is the same and lives here: ask for a worker,
start (with failover), then either stream the reply's events, ending with an in-band error event
if the stream fails and always with ``[DONE]``, or wait for every choice's final chunk (aborted
if the client leaves) and answer once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmplatform.errors import LLMPlatformError, ModelNotFoundError, NoWorkerError
from llmplatform.metrics.gateway import note_model
from llmplatform.openai_api.errors import error_payload
from llmplatform.openai_api.lifecycle import Lifecycle
from llmplatform.openai_api.sse import DONE, EventStreamResponse, sse_event
from llmplatform.openai_api.streams import ChoiceStreams, RequestStreams, until_disconnected
from llmplatform.openai_api.tenants import Tenants, Ticket, ticket_of
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.openai_api.worker_routing import RouteRequest, session_key
from llmplatform.protocol.openai import Usage
from llmplatform.protocol.worker import WorkerChunk

logger = logging.getLogger("llmplatform.openai_api")

ON_DEMAND_KEEP_ALIVE_S = 2.0
"""Seconds between SSE keep-alive comments while a streamed request waits for its model."""
KEEP_ALIVE_COMMENT = b": keep-alive\n\n"

P = TypeVar("P")
P_contra = TypeVar("P_contra", contravariant=True)

StartOn = Callable[[str], Awaitable[tuple[P, ChoiceStreams]]]
"""Starts a request's choices on the worker at an address: (what was prepared there, the streams)."""


@dataclass(frozen=True)
class Framing:
    """What a dialect's event stream sends after its status line went out: a failure (the
    dialect's error event) and the end of the stream."""

    error_event: Callable[[LLMPlatformError], bytes]
    end: bytes


OPENAI_FRAMING = Framing(lambda exc: sse_event(error_payload(exc)), DONE)
"""OpenAI's: the error envelope as a data event; ``[DONE]`` last."""


class Reply(Protocol[P_contra]):
    """How one endpoint turns worker chunks into its answer."""

    response_id: str

    def response(self, final_chunks: list[WorkerChunk]) -> BaseModel:
        """The whole answer, from each choice's last (cumulative) chunk."""
        ...

    def events(self, streams: RequestStreams[P_contra]) -> AsyncGenerator[bytes, None]:
        """The answer's SSE events as the chunks arrive; failures propagate (see `_event_stream`)."""
        ...

    def usage(self, last_chunks: list[WorkerChunk | None]) -> Usage:
        """The tokens used, from each choice's latest chunk (None: it sent none)."""
        ...


def worker_client(request: Request) -> WorkerClient:
    return request.app.state.worker_client


def tenants(request: Request) -> Tenants:
    return request.app.state.tenants


def route_request(request: Request, routing_text: str, user: str | None,
                  cache_salt: str | None = None) -> RouteRequest:
    """What a generation request offers routing: its prompt's routing text, its session key and
    the cache salt it is sent with (routing matches it among the salt's own prefixes)."""
    header = request.app.state.settings.session_header
    return RouteRequest(routing_text, session_key(request.headers, header, user), cache_salt)


async def answer(request: Request, model: str, start_on: StartOn[P],
                 reply: Callable[[Callable[[], P]], Reply[P]], *, stream: bool,
                 route: RouteRequest | None = None, framing: Framing = OPENAI_FRAMING) -> Response:
    """Serve a checked generation request. `reply` is given a getter of what `start_on` prepared
    on the worker that answered (failover may change it until the first chunk). `route` informs
    the first pick only: a failover pick ranks by load (the preferred worker just failed).

    A model no worker serves that is launchable on demand is started first: waited for (up to
    --on-demand-timeout), a streamed answer sending SSE keep-alive comments meanwhile. `framing`:
    the dialect's stream errors and end."""
    client = worker_client(request)
    streams = RequestStreams(client, model, start_on)
    try:
        address = await client.worker_address(model, route=route)
        note_model(request, model)  # a model some worker serves: never an unknown name as a label
        await streams.start(address)
    except (ModelNotFoundError, NoWorkerError):
        # No worker, or none of those routing knew could take it: an on-demand model may just
        # have been unloaded (its stopped worker still in the routing table for a moment).
        lifecycle: Lifecycle = request.app.state.lifecycle
        starting = await lifecycle.ensure(model)
        if starting is None:
            raise  # not launchable: the 404 or 503 stands
        if stream:
            return EventStreamResponse(_cold_event_stream(
                request, lifecycle.wait_ready(starting), model, start_on, reply, route, framing),
                headers_first=True)
        await lifecycle.wait_ready(starting)
        address = await client.worker_address(model, route=route)
        note_model(request, model)
        streams = RequestStreams(client, model, start_on)
        await streams.start(address)
    replying = reply(lambda: streams.prepared)
    ticket = ticket_of(request)
    if stream:
        return EventStreamResponse(_event_stream(replying, streams, ticket, framing), on_close=streams.aclose,
                                   headers_first=streams.accepted_early)
    try:
        final_chunks = await until_disconnected(request, streams.final_chunks())
    finally:
        await streams.aclose()
        _charge(ticket, replying, streams)
    return JSONResponse(replying.response(final_chunks).model_dump())


async def _cold_event_stream(request: Request, ready: Awaitable[None], model: str,
                             start_on: StartOn[P], reply: Callable[[Callable[[], P]], Reply[P]],
                             route: RouteRequest | None, framing: Framing) -> AsyncIterator[bytes]:
    """A streamed answer from a model being started: keep-alive comments until it is ready
    (clients and proxies would otherwise time out an idle stream), then the answer. The status
    line (200) has gone out first, so a failure to start is an in-band error event."""
    waiting = asyncio.ensure_future(ready)
    streams: RequestStreams[P] | None = None
    try:
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=ON_DEMAND_KEEP_ALIVE_S)
            if not waiting.done():
                yield KEEP_ALIVE_COMMENT
        waiting.result()
        client = worker_client(request)
        note_model(request, model)
        streams = RequestStreams(client, model, start_on)
        await streams.start(await client.worker_address(model, route=route))
        async for event in _event_stream(reply(lambda: streams.prepared), streams,
                                         ticket_of(request), framing):
            yield event
    except LLMPlatformError as exc:
        yield framing.error_event(exc)
        yield framing.end
    finally:
        waiting.cancel()
        if streams is not None:
            await streams.aclose()


def _charge(ticket: Ticket | None, reply: Reply[P], streams: RequestStreams[P]) -> None:
    """Report the tokens used to the tenant's limits and counters (whatever ended the answer:
    what the workers computed before a disconnect was used too)."""
    if ticket is not None:
        usage = reply.usage(streams.last_chunks)
        ticket.charge(usage.prompt_tokens, usage.completion_tokens)


async def _event_stream(reply: Reply[P], streams: RequestStreams[P], ticket: Ticket | None,
                        framing: Framing) -> AsyncIterator[bytes]:
    """`reply`'s events, then the end (``[DONE]``). The status line has gone out with the
    first event, so a failure after it is reported in-band, as the dialect's error event."""
    try:
        async with contextlib.aclosing(reply.events(streams)) as events:
            async for event in events:
                yield event
    except LLMPlatformError as exc:
        yield framing.error_event(exc)
    except Exception:
        logger.exception("stream %s failed", reply.response_id)
        yield framing.error_event(LLMPlatformError("The server had an error while streaming."))
    finally:
        streams.cancel()
        _charge(ticket, reply, streams)
    yield framing.end
