"""The generation routes' work: a request parsed, admitted and checked whole (:func:`generate`),
then answered as a stream of frames (:func:`streamed`) or as its last frame (:func:`whole`).

The stream is the backend's chunks made FastChat frames (:mod:`.framing`), one set of frames per
output (``n``); errors after the answer has begun travel inside it. The backend's generator is
closed in ``finally`` whatever ends the stream, which frees the request there.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from llmplatform.errors import ErrorCode, LLMPlatformError
from llmplatform.llm.base import FinishReason, GenerateChunk, LLMBackend, Usage
from llmplatform.model_worker.admission import (Ticket, TicketedStreamingResponse, WorkerState,
                                               refusal_response)
from llmplatform.model_worker.framing import frames_for
from llmplatform.model_worker.requests import Accepted, accept
from llmplatform.protocol.worker import ACCEPTED_HEADER, WorkerParams, error_chunk
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.logs import request_context

logger = logging.getLogger("llmplatform.worker")


async def generate_chunks(app: FastAPI, accepted: Accepted, ticket: Ticket, *,
                           streamed: bool) -> AsyncIterator[bytes]:
    """The worker's stream: JSON objects each followed by NUL; errors in-band. Delta frames when
    `streamed` and the peer asked for them (:func:`frames_for`), FastChat's cumulative ones
    otherwise. An abort (:class:`Generation`) ends it with a last frame whose finish_reason is
    ``abort``; a hang-up closes it from outside. Either way the backend's generator is closed in
    ``finally``, which frees the request there."""
    llm: LLMBackend = app.state.llm
    state: WorkerState = app.state.worker
    request, params, observer = accepted.request, accepted.params, accepted.observer
    generation = ticket.generation
    assert generation is not None, "accept() reserved the request's id"
    try:
        logger.debug("received: max_new_tokens=%s temperature=%s", request.params.max_tokens,
                     request.params.temperature)
        async with state.slot():
            observer.started()
            # One set of frames per output (n > 1: the outputs' chunks come interleaved).
            streams = [frames_for(params, accepted.prompt, streamed=streamed)
                       for _ in range(request.params.n)]
            generator = llm.generate(request)
            usages = [Usage(len(request.prompt_token_ids), 0)] * request.params.n
            unfinished = set(range(request.params.n))
            sent: set[int] = set()
            try:
                while (chunk := await generation.next_chunk(generator)) is not None:
                    index = chunk.index
                    usages[index] = chunk.usage
                    observer.on_chunk(chunk)
                    out = streams[index].update(chunk)
                    if chunk.finish_reason is not None and chunk.error:
                        yield error_chunk(chunk.error,
                                          chunk.error_code or ErrorCode.INTERNAL_ERROR)
                        return
                    if index not in sent or chunk.text or chunk.finish_reason is not None or chunk.logprobs:
                        yield out.encode()
                        sent.add(index)
                    if chunk.finish_reason is not None:
                        unfinished.discard(index)
                        if not unfinished:
                            return
                if generation.aborted:
                    logger.debug("aborted by /worker_abort")
                    for index in sorted(unfinished):
                        yield streams[index].update(GenerateChunk(
                            request.request_id, "", (), usages[index], FinishReason.ABORT,
                            index=index)).encode()
            except LLMPlatformError as exc:
                observer.failed()
                logger.info("failed: %s", exc.message)
                yield error_chunk(exc.message, exc.error_code, exc.param)
            except Exception as exc:  # a backend bug must not take the worker down
                observer.failed()
                logger.exception("generation %s failed", request.request_id)
                yield error_chunk(f"internal error: {type(exc).__name__}: {exc}",
                                  ErrorCode.INTERNAL_ERROR)
            finally:
                # Runs on normal end, on error, on abort and when the client disconnects
                # (cancellation): closing the backend's generator frees the request there.
                await generator.aclose()
    finally:
        ticket.release()
        # Scoped here: after a disconnect this runs from whoever closed the stream.
        if observer.close() is not None:
            with request_context(request.request_id):
                logger.info("finished: %s", observer.describe())


Answer = Callable[[FastAPI, Accepted, Ticket], Awaitable[Response]]


async def generate(app: FastAPI, request: Request, *, refuse: Callable[[bytes], Response],
                    answer: Answer) -> Response:
    """One generation request: parsed, given a ticket (a busy worker's refusal otherwise),
    checked whole (:func:`accept`), then answered by `answer`, which owns the ticket from then
    on. A refusal's FastChat error chunk (NUL-terminated) is sent as `refuse` wraps it."""
    llm: LLMBackend = app.state.llm
    try:
        params = parse_json_body(WorkerParams, await request.body())
    except LLMPlatformError as exc:
        return refuse(error_chunk(exc.message, ErrorCode.VALIDATION_TYPE_ERROR, exc.param))
    if (params.n or 1) > 1 and answer is whole:
        # One JSON answer holds one output (FastChat's shape): several are streamed.
        return refuse(error_chunk("n > 1 is served by /worker_generate_stream only",
                                  ErrorCode.PARAM_OUT_OF_RANGE, "n"))
    try:
        ticket = app.state.worker.admit(llm)
    except LLMPlatformError as exc:
        return refusal_response(exc)
    try:
        accepted = await accept(llm, params, ticket, metrics=app.state.metrics)
    except LLMPlatformError as exc:
        ticket.release()
        return refuse(error_chunk(exc.message, exc.error_code, exc.param))
    except BaseException:
        ticket.release()
        raise
    return await answer(app, accepted, ticket)


async def streamed(app: FastAPI, accepted: Accepted, ticket: Ticket) -> Response:
    """The chunks as they come (the response releases the ticket when it ends). The request is
    checked whole: the header tells a gateway of ours so (a stock one ignores it)."""
    return TicketedStreamingResponse(generate_chunks(app, accepted, ticket, streamed=True), ticket,
                                     headers={ACCEPTED_HEADER: "1"})


async def whole(app: FastAPI, accepted: Accepted, ticket: Ticket) -> Response:
    """The last (cumulative) chunk alone, once generation has ended."""
    last = b""
    chunks = generate_chunks(app, accepted, ticket, streamed=False)
    try:
        async for item in chunks:
            last = item
    finally:
        await chunks.aclose()
        ticket.release()
    return json_object(last)


def json_object(chunk: bytes) -> Response:
    """One NUL-terminated chunk as a JSON answer (``/worker_generate``'s form)."""
    return Response(chunk.rstrip(b"\0"), media_type="application/json")
