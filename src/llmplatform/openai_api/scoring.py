"""``POST /v1/rerank`` and ``POST /v1/score``: relevance of texts, served by workers through
``/worker_score``.

Both are pairs in the end: rerank's query against each document, score's ``text_1`` against each
``text_2`` (one against many, or two lists of the same length pairwise, as vLLM pairs them). A
request goes to one worker in one call, routed like embeddings (the routing table or the
controller, failover); the worker batches its pairs with other requests'. What the worker's model
serves comes from its ``/model_details`` (``tasks``): a cross-encoder (``score``) reads each pair
together; an embedding model (``embed``) answers with its vectors' cosine, and the answer says
which (``model_info.scoring``); a generation model is a 400 naming ``model``, before anything is
sent. A stock FastChat worker announces no tasks and has no ``/worker_score``: a 400 too.

Errors name the client's fields: the worker's ``text_1`` / ``text_2`` become rerank's ``query``
/ ``documents``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmplatform.errors import InvalidRequestError, LLMPlatformError
from llmplatform.metrics.gateway import note_model
from llmplatform.openai_api.errors import UpstreamError, error_from_http
from llmplatform.openai_api.failover import with_failover
from llmplatform.openai_api.tenants import ticket_of
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.protocol.scoring import RerankDocument, RerankRequest, ScoreRequest
from llmplatform.protocol.worker import MAX_SCORE_PAIRS
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.request_id import worker_request_id_prefix

_RERANK_FIELDS = {"text_1": "query", "text_2": "documents"}


async def create_rerank(request: Request) -> Response:
    body = parse_json_body(RerankRequest, await request.body())
    unserved = body.unserved()
    if unserved is not None:
        raise InvalidRequestError(f"'{unserved}' is not supported: documents are ranked by their "
                                  "text, whole", param=unserved)
    documents = [doc.text if isinstance(doc, RerankDocument) else doc for doc in body.documents]
    _check_count(len(documents), "documents")
    scores, num_tokens, scoring = await _scores(
        request, body.model, [body.query] * len(documents), documents,
        body.truncate_prompt_tokens, fields=_RERANK_FIELDS)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep input order
    if body.top_n:
        order = order[:body.top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    answer = {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": body.model,
              "results": results,
              "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
              "model_info": {"scoring": scoring}}
    return _json(answer)


async def create_score(request: Request) -> Response:
    body = parse_json_body(ScoreRequest, await request.body())
    text_1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    text_2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    for name, texts in (("text_1", text_1), ("text_2", text_2)):
        if not texts:
            raise InvalidRequestError(f"'{name}' must not be empty: give a string or a list of "
                                      "strings", param=name)
    if len(text_1) == 1:
        text_1 = text_1 * len(text_2)  # one against many
    elif len(text_1) != len(text_2):
        raise InvalidRequestError(
            f"'text_1' holds {len(text_1)} texts and 'text_2' {len(text_2)}: give one text_1, or "
            "lists of the same length (scored pairwise)", param="text_2")
    _check_count(len(text_2), "text_2")
    scores, num_tokens, scoring = await _scores(request, body.model, text_1, text_2,
                                                body.truncate_prompt_tokens, fields={})
    answer = {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
              "model": body.model,
              "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
              "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
              "model_info": {"scoring": scoring}}
    return _json(answer)


def _check_count(count: int, field: str) -> None:
    if count == 0:
        raise InvalidRequestError(f"'{field}' must not be empty", param=field)
    if count > MAX_SCORE_PAIRS:
        raise InvalidRequestError(f"'{field}' holds {count} texts; at most {MAX_SCORE_PAIRS} are "
                                  "allowed per request", param=field)


async def _scores(request: Request, model: str, text_1: list[str], text_2: list[str],
                  truncate_prompt_tokens: int | None, *,
                  fields: dict[str, str]) -> tuple[list[float], int, str]:
    """(one score per pair, tokens read, ``cross-encoder`` or ``cosine``) from a worker."""
    client: WorkerClient = request.app.state.worker_client
    address = await client.worker_address(model)
    note_model(request, model)
    request_id = worker_request_id_prefix(request)

    async def attempt(address: str) -> tuple[list[float], int, str]:
        tasks = (await client.model_details(address, model)).raw.get("tasks")
        if not isinstance(tasks, list):
            raise InvalidRequestError(f"model {model!r} is served by a worker that does not "
                                      "serve scores (a stock FastChat worker)", param="model")
        if "score" not in tasks and "embed" not in tasks:
            raise InvalidRequestError(
                f"model {model!r} is a generation model and serves no scores; use a "
                "cross-encoder (reranker) or an embedding model (GET /v1/models lists what each "
                "model serves)", param="model")
        payload = {"model": model, "text_1": text_1, "text_2": text_2,
                   "truncate_prompt_tokens": truncate_prompt_tokens,
                   "request_id": f"{request_id}-score"}
        return await _call(client, address, payload, len(text_2))

    try:
        scores, num_tokens, scoring = await with_failover(client, model, attempt, address=address)
    except LLMPlatformError as exc:
        if exc.param in fields:  # the worker's names for the client's fields
            exc.param = fields[exc.param]
            for worker_name, client_name in fields.items():
                exc.message = exc.message.replace(f"'{worker_name}'", f"'{client_name}'")
        raise
    ticket = ticket_of(request)
    if ticket is not None:  # the tenant's tokens per minute and counters
        ticket.charge(num_tokens, 0)
    return scores, num_tokens, scoring


async def _call(client: WorkerClient, address: str, payload: dict[str, Any],
                num_pairs: int) -> tuple[list[float], int, str]:
    url = f"{address}/worker_score"
    data = await client.post_worker(address, "/worker_score", payload)
    if isinstance(data, dict) and data.get("error_code"):
        raise error_from_http(200, json.dumps(data).encode(), f"The worker at {url}")
    scores = data.get("scores") if isinstance(data, dict) else None
    num_tokens = data.get("token_num") if isinstance(data, dict) else None
    scoring = data.get("scoring") if isinstance(data, dict) else None
    if (not isinstance(scores, list) or len(scores) != num_pairs
            or not all(isinstance(s, (int, float)) for s in scores)
            or not isinstance(num_tokens, int) or scoring not in ("cross-encoder", "cosine")):
        raise UpstreamError(f"The worker at {url} answered with an invalid response "
                            f"(not {num_pairs} scores, a token count and the scoring).")
    return [float(s) for s in scores], num_tokens, scoring


def _json(answer: dict[str, Any]) -> Response:
    return Response(json.dumps(answer, separators=(",", ":")), media_type="application/json")
