"""``/worker_score`` (ours): the relevance of text pairs, for the gateway's rerank and score.

A cross-encoder (``ModelTask.SCORE``) reads each pair together (:meth:`LLMBackend.score`). An
embedding model (``ModelTask.EMBED``) scores a pair as the cosine of its two texts' vectors,
each distinct text embedded once (a query against N documents is N + 1 inputs, batched with
other requests' as embeddings are); the answer says which (``scoring``). A generation model
serves no scores: a 400 naming ``model``.

Everything a request can fail is checked before the backend sees it: the model and what it
serves, and lengths (``context_length_exceeded`` naming ``text_1`` or ``text_2``, unless
``truncate_prompt_tokens`` asks to cut). Errors are FastChat's error object with HTTP 200, as
``/worker_get_embeddings`` answers; a full queue or a dead backend is refused with its status.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmplatform.errors import ContextLengthExceededError, ErrorCode, LLMPlatformError
from llmplatform.llm.base import LLMBackend
from llmplatform.llm.embedding import ModelTask, truncation_limit
from llmplatform.llm.scoring import check_pair_lengths, not_a_scoring_model
from llmplatform.model_worker.admission import refusal_response
from llmplatform.model_worker.requests import check_model
from llmplatform.protocol.worker import WorkerScoreRequest

logger = logging.getLogger("llmplatform.worker")

CROSS_ENCODER = "cross-encoder"
COSINE = "cosine"


async def score_answer(llm: LLMBackend, body: WorkerScoreRequest) -> dict[str, Any]:
    """The route's answer for an admitted request; typed errors for refusals."""
    check_model(llm, body.model)
    facts = llm.facts
    model = body.model or llm.model_names[0]
    if ModelTask.SCORE in facts.tasks:
        limit = truncation_limit(body.truncate_prompt_tokens, facts.context_length)
        pairs = await asyncio.to_thread(llm.score_token_ids_sync, body.text_1, body.text_2, limit)
        check_pair_lengths(pairs, facts.context_length, "text_2")
        scores = await llm.score(pairs, request_id=body.request_id)
        return {"scores": scores, "token_num": sum(len(pair) for pair in pairs),
                "scoring": CROSS_ENCODER}
    if ModelTask.EMBED in facts.tasks and facts.embedding is not None:
        scores, num_tokens = await _cosine_scores(llm, body, facts.embedding.max_input_tokens)
        return {"scores": scores, "token_num": num_tokens, "scoring": COSINE}
    raise not_a_scoring_model(model)


async def _cosine_scores(llm: LLMBackend, body: WorkerScoreRequest,
                         max_input_tokens: int) -> tuple[list[float], int]:
    limit = truncation_limit(body.truncate_prompt_tokens, max_input_tokens)
    # Each distinct text once, the first texts' before the second's (an error names its side).
    distinct = list(dict.fromkeys(body.text_1 + body.text_2))
    token_ids = await asyncio.to_thread(llm.embedding_token_ids_sync, distinct, limit)
    first = set(body.text_1)
    for text, ids in zip(distinct, token_ids):
        if len(ids) > max_input_tokens:
            field = "text_1" if text in first else "text_2"
            raise ContextLengthExceededError(
                f"a text of '{field}' has {len(ids)} tokens, more than this model's maximum of "
                f"{max_input_tokens}; shorten it, or set 'truncate_prompt_tokens' to cut it",
                param=field)
    results = await llm.embed(token_ids, request_id=body.request_id)
    vectors = {text: result.vector for text, result in zip(distinct, results)}
    scores = [_cosine(vectors[a], vectors[b]) for a, b in zip(body.text_1, body.text_2)]
    return scores, sum(result.num_tokens for result in results)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denominator = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    return float(np.dot(a, b)) / denominator if denominator > 0 else 0.0


def add_score_route(app: FastAPI, parse_body: Any) -> None:
    """Registers ``POST /worker_score``; ``parse_body(request, model)`` is the worker's JSON
    parser (typed InvalidRequestError naming the field)."""

    @app.post("/worker_score")
    async def worker_score(request: Request) -> Response:
        llm: LLMBackend = app.state.llm
        try:
            body = await parse_body(request, WorkerScoreRequest)
        except LLMPlatformError as exc:
            return _error(exc)
        try:
            ticket = app.state.worker.admit(llm)
        except LLMPlatformError as exc:
            return refusal_response(exc)
        try:
            return JSONResponse(await score_answer(llm, body))
        except LLMPlatformError as exc:
            logger.info("scores refused: %s", exc.message)
            return _error(exc)
        except Exception as exc:  # a backend bug must not take the worker down
            logger.exception("scores failed")
            return JSONResponse({"text": f"internal error: {type(exc).__name__}: {exc}",
                                 "error_code": ErrorCode.INTERNAL_ERROR})
        finally:
            ticket.release()


def _error(exc: LLMPlatformError) -> JSONResponse:
    error: dict[str, Any] = {"text": exc.message, "error_code": exc.error_code}
    if exc.param is not None:
        error["param"] = exc.param
    return JSONResponse(error)
