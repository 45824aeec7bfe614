"""``POST /v1/embeddings``: OpenAI's embeddings, served by workers through ``/worker_get_embeddings``.

The request is routed like a chat request (the routing table or the controller picks a worker
serving the model; one that cannot take it is replaced, up to ``max_worker_attempts``). What the
worker's model serves comes from its ``/model_details`` (``tasks``): embeddings from a model of
ours that only generates are refused here with a 400 that says so, and ``dimensions`` and
token-id inputs go to our workers only. A stock FastChat worker announces no tasks; it gets
FastChat's own request (texts, four per call, as FastChat's gateway sends them), since its
``/worker_get_embeddings`` embeds with whatever model it serves.

All of a request's inputs go to one worker of ours in one call (the worker batches them with
other requests'), as base64 float32: a quarter of the bytes of JSON floats and no float parsing.
A base64 answer is passed through untouched when the client asked for base64 too (the
``openai`` client does by default).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from llmplatform.errors import InvalidRequestError
from llmplatform.metrics.gateway import note_model
from llmplatform.openai_api.errors import UpstreamError, error_from_http
from llmplatform.openai_api.failover import with_failover
from llmplatform.openai_api.tenants import ticket_of
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.protocol.openai import EmbeddingRequest
from llmplatform.protocol.worker import MAX_EMBEDDING_INPUTS
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.request_id import worker_request_id_prefix

STOCK_WORKER_BATCH = 4
"""Inputs per call to a stock FastChat worker: FastChat's gateway's own batch size (a stock
worker pads its whole call into one forward pass)."""

Inputs = list[str] | list[list[int]]


def request_inputs(body: EmbeddingRequest) -> Inputs:
    """The request's inputs as a list of texts or of token id lists (400 naming ``input``)."""
    raw = body.input
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise InvalidRequestError("'input' must not be empty: give a string, a list of strings, a "
                                  "list of token ids or a list of such lists", param="input")
    if isinstance(raw[0], int):
        return [list(raw)]  # type: ignore[arg-type]  (a list of token ids is one input)
    if len(raw) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"'input' holds {len(raw)} inputs; at most "
                                  f"{MAX_EMBEDDING_INPUTS} are allowed per request", param="input")
    if isinstance(raw[0], list) and any(not ids for ids in raw):
        raise InvalidRequestError("'input' holds an empty list of token ids", param="input")
    return raw  # type: ignore[return-value]


async def create_embeddings(request: Request) -> Response:
    body = parse_json_body(EmbeddingRequest, await request.body())
    inputs = request_inputs(body)
    client: WorkerClient = request.app.state.worker_client
    address = await client.worker_address(body.model)
    note_model(request, body.model)
    request_id = worker_request_id_prefix(request)

    async def attempt(address: str) -> tuple[list[np.ndarray | str], int]:
        details = (await client.model_details(address, body.model)).raw
        tasks = details.get("tasks")
        if isinstance(tasks, list):  # ours
            if "embed" not in tasks:
                what = ("a cross-encoder (reranker): it serves /v1/rerank and /v1/score, not "
                        "embeddings" if "score" in tasks else
                        "a generation model and serves no embeddings")
                raise InvalidRequestError(
                    f"model {body.model!r} is {what}; use an embedding model (GET /v1/models "
                    "lists what each model serves)", param="model")
            payload = {"model": body.model, "input": inputs, "encoding_format": "base64",
                       "dimensions": body.dimensions,
                       "truncate_prompt_tokens": body.truncate_prompt_tokens,
                       "request_id": f"{request_id}-emb"}
            return await _call(client, address, payload, len(inputs))
        return await _stock_worker(client, address, body, inputs)

    vectors, num_tokens = await with_failover(client, body.model, attempt, address=address)
    ticket = ticket_of(request)
    if ticket is not None:  # the tenant's tokens per minute and counters
        ticket.charge(num_tokens, 0)
    data = [{"object": "embedding", "index": index,
             "embedding": _encoded(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)]
    answer = {"object": "list", "data": data, "model": body.model,
              "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return Response(json.dumps(answer, separators=(",", ":")), media_type="application/json")


async def _stock_worker(client: WorkerClient, address: str, body: EmbeddingRequest,
                        inputs: Inputs) -> tuple[list[np.ndarray | str], int]:
    for field, value in (("dimensions", body.dimensions),
                         ("truncate_prompt_tokens", body.truncate_prompt_tokens)):
        if value is not None:
            raise InvalidRequestError(f"model {body.model!r} is served by a worker that does not "
                                      f"support '{field}'", param=field)
    if not all(isinstance(item, str) for item in inputs):
        raise InvalidRequestError(f"model {body.model!r} is served by a worker that takes text "
                                  "inputs only, not token ids", param="input")
    batches = [inputs[i:i + STOCK_WORKER_BATCH] for i in range(0, len(inputs), STOCK_WORKER_BATCH)]
    answers = await asyncio.gather(*(
        _call(client, address, {"model": body.model, "input": batch}, len(batch)) for batch in batches))
    return [v for vectors, _ in answers for v in vectors], sum(tokens for _, tokens in answers)


async def _call(client: WorkerClient, address: str, payload: Mapping[str, Any],
                num_inputs: int) -> tuple[list[np.ndarray | str], int]:
    url = f"{address}/worker_get_embeddings"
    data = await client.post_worker(address, "/worker_get_embeddings", payload)
    if isinstance(data, dict) and data.get("error_code"):
        raise error_from_http(200, json.dumps(data).encode(), f"The worker at {url}")
    vectors = data.get("embedding") if isinstance(data, dict) else None
    num_tokens = data.get("token_num") if isinstance(data, dict) else None
    if (not isinstance(vectors, list) or len(vectors) != num_inputs
            or not isinstance(num_tokens, int) or not all(_is_vector(v) for v in vectors)):
        raise UpstreamError(f"The worker at {url} answered with an invalid response "
                            f"(not {num_inputs} embeddings and a token count).")
    return vectors, num_tokens


def _is_vector(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and bool(value)
                                      and all(isinstance(x, (int, float)) for x in value))


def _encoded(vector: np.ndarray | str | Sequence[float], encoding_format: str | None) -> Any:
    """A vector as the client asked: JSON floats (default) or base64 float32 little-endian.
    ``vector`` is a worker's base64 string or its list of floats."""
    if isinstance(vector, str):
        if encoding_format == "base64":
            return vector  # already what the client wants
        try:
            return np.frombuffer(base64.b64decode(vector, validate=True), dtype="<f4").tolist()
        except ValueError:  # binascii.Error, or a length that is not whole float32s
            raise UpstreamError("A worker answered with an invalid base64 embedding.") from None
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)


async def model_tasks(client: WorkerClient) -> dict[str, list[str]]:
    """What each model serves, from the controller's worker listing (ours): the union over its
    workers that report it. Empty from a stock controller (no listing): nothing is claimed."""
    listing = await client.list_workers()
    tasks: dict[str, set[str]] = {}
    for worker in listing.workers if listing is not None else ():
        for name in worker.model_names:
            if worker.tasks is not None:
                tasks.setdefault(name, set()).update(worker.tasks)
    return {name: sorted(served) for name, served in tasks.items()}
