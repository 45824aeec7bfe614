"""``/worker_get_embeddings``: FastChat's embeddings route, around :meth:`LLMBackend.embed`.

A stock FastChat gateway sends ``{"model", "input": [str], "encoding_format"}`` and reads
``{"embedding": [...], "token_num": N}``; ours adds token-id inputs, ``dimensions`` and
``truncate_prompt_tokens`` (``WorkerEmbeddingsRequest``). Everything a request can fail is
checked before the backend sees it: the model and what it serves, token ids against the
vocabulary, lengths (``context_length_exceeded`` unless truncation was asked for). A refusal is
FastChat's error object with HTTP 200 (a stock gateway reads the body whatever the status);
a full queue or a dead backend is refused with its status first, as for generation.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmplatform.errors import ErrorCode, InvalidRequestError, LLMPlatformError
from llmplatform.llm.base import LLMBackend
from llmplatform.llm.embedding import (ModelTask, check_dimensions, check_lengths, cut_token_ids,
                                       not_an_embedding_model, truncate_vector, truncation_limit)
from llmplatform.model_worker.admission import refusal_response
from llmplatform.model_worker.requests import check_model
from llmplatform.protocol.worker import WorkerEmbeddingsRequest

logger = logging.getLogger("llmplatform.worker")


def embedding_details(llm: LLMBackend) -> dict[str, Any]:
    """What ``/model_details`` adds: the tasks served and, for an embedding model, its facts."""
    facts = llm.facts
    details: dict[str, Any] = {"tasks": [task.value for task in facts.tasks]}
    if facts.embedding is not None:
        details["embedding"] = facts.embedding.to_wire()
    return details


def encode_vector(vector: np.ndarray, encoding_format: str | None) -> list[float] | str:
    """A float list, or (``base64``) the float32 little-endian bytes, as OpenAI and FastChat do."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.astype(np.float32, copy=False).tolist()


async def embeddings_answer(llm: LLMBackend, body: WorkerEmbeddingsRequest) -> dict[str, Any]:
    """The route's answer for an admitted request; typed errors for refusals."""
    check_model(llm, body.model)
    facts = llm.facts
    model = body.model or llm.model_names[0]
    if ModelTask.EMBED not in facts.tasks or facts.embedding is None:
        if ModelTask.SCORE in facts.tasks:
            raise InvalidRequestError(f"model {model!r} is a cross-encoder (reranker): it serves "
                                      "/v1/rerank and /v1/score, not embeddings", param="model")
        raise not_an_embedding_model(model)
    check_dimensions(facts.embedding, model, body.dimensions)
    limit = truncation_limit(body.truncate_prompt_tokens, facts.embedding.max_input_tokens)
    token_ids = await _token_ids(llm, body.input, limit)
    check_lengths(token_ids, facts.embedding.max_input_tokens)
    results = await llm.embed(token_ids, request_id=body.request_id)
    normalized = facts.embedding.normalized
    return {"embedding": [encode_vector(truncate_vector(r.vector, body.dimensions, normalized),
                                        body.encoding_format) for r in results],
            "token_num": sum(r.num_tokens for r in results)}


async def _token_ids(llm: LLMBackend, inputs: str | list[str] | list[list[int]],
                     limit: int | None) -> list[list[int]]:
    if isinstance(inputs, str):
        inputs = [inputs]
    if all(isinstance(item, str) for item in inputs):
        # One thread hop for the whole list: a fast tokenizer batches it.
        return await asyncio.to_thread(llm.embedding_token_ids_sync, inputs, limit)
    vocab_size = llm.facts.vocab_size
    side = getattr(llm.tokenizer, "truncation_side", "right")
    lists: list[list[int]] = []
    for index, ids in enumerate(inputs):
        assert isinstance(ids, list)
        if not ids:
            raise InvalidRequestError(f"input {index} is an empty list of token ids", param="input")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"input {index} has token id {bad}, outside this model's "
                                      f"vocabulary [0, {vocab_size})", param="input")
        lists.append(cut_token_ids(ids, limit, side) if limit is not None else ids)
    return lists


def _error(exc: LLMPlatformError) -> JSONResponse:
    error: dict[str, Any] = {"text": exc.message, "error_code": exc.error_code}
    if exc.param is not None:
        error["param"] = exc.param
    return JSONResponse(error)


def add_embedding_route(app: FastAPI, parse_body: Any) -> None:
    """Registers ``POST /worker_get_embeddings``; ``parse_body(request, model)`` is the worker's
    JSON parser (typed InvalidRequestError naming the field)."""

    @app.post("/worker_get_embeddings")
    async def worker_get_embeddings(request: Request) -> Response:
        llm: LLMBackend = app.state.llm
        try:
            body = await parse_body(request, WorkerEmbeddingsRequest)
        except LLMPlatformError as exc:
            return JSONResponse({"text": exc.message, "error_code": ErrorCode.VALIDATION_TYPE_ERROR,
                                 "param": exc.param})
        try:
            ticket = app.state.worker.admit(llm)
        except LLMPlatformError as exc:
            return refusal_response(exc)
        try:
            return JSONResponse(await embeddings_answer(llm, body))
        except LLMPlatformError as exc:
            logger.info("embeddings refused: %s", exc.message)
            return _error(exc)
        except Exception as exc:  # a backend bug must not take the worker down
            logger.exception("embeddings failed")
            return JSONResponse({"text": f"internal error: {type(exc).__name__}: {exc}",
                                 "error_code": ErrorCode.INTERNAL_ERROR})
        finally:
            ticket.release()

