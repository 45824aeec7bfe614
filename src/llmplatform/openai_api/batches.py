"""OpenAI's Batch API: ``/v1/batches`` (create, list), ``/v1/batches/{id}`` (retrieve) and
``/v1/batches/{id}/cancel``.

Creating a batch checks what the request itself says (endpoint, window, metadata, an input
file of purpose ``batch`` that the caller owns: a 400 naming the field otherwise) and stores
the batch as ``validating``; the runner (openai_api.batch_runner) checks the file's lines and
runs them. Cancelling marks it ``cancelling`` and tells the runner, which aborts the lines in
flight at once and writes what finished to the output files (``cancelled``). A batch is its
creator's alone, like its files (openai_api.batch_store).
"""

from __future__ import annotations

import secrets
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from llmplatform.errors import ConflictError, InvalidRequestError
from llmplatform.openai_api.batch_runner import BatchRunner
from llmplatform.openai_api.batch_store import FileNotFoundInStoreError
from llmplatform.openai_api.files import batch_store
from llmplatform.openai_api.tenants import owner_of
from llmplatform.protocol.batches import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOWS,
    Batch,
    BatchCreateRequest,
    BatchList,
)
from llmplatform.utils.json_body import parse_json_body

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512
_CANCELLABLE = ("validating", "in_progress")


def batch_runner(request: Request) -> BatchRunner:
    return request.app.state.batch_runner


async def create_batch(request: Request) -> JSONResponse:
    body = parse_json_body(BatchCreateRequest, await request.body())
    if body.endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequestError(f"Invalid value for 'endpoint': {body.endpoint[:64]!r} is not one of "
                                  f"{', '.join(BATCH_ENDPOINTS)}.", param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequestError(f"Invalid value for 'completion_window': only "
                                  f"{', '.join(COMPLETION_WINDOWS)} is supported.",
                                  param="completion_window")
    for key, value in (body.metadata or {}).items():
        if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
            raise InvalidRequestError(
                f"Invalid value for 'metadata': keys are at most {_MAX_METADATA_KEY} characters "
                f"and values at most {_MAX_METADATA_VALUE}.", param="metadata")
    store, owner = batch_store(request), owner_of(request)
    try:
        file = await store.get_file(owner, body.input_file_id)
    except FileNotFoundInStoreError:
        raise InvalidRequestError(f"Invalid value for 'input_file_id': no file "
                                  f"'{body.input_file_id[:64]}' was found.", param="input_file_id") from None
    if file.purpose != "batch":
        raise InvalidRequestError(f"Invalid value for 'input_file_id': the file has purpose "
                                  f"'{file.purpose}'; a batch's input file must have purpose 'batch'.",
                                  param="input_file_id")
    now = int(time.time())
    batch = Batch(id=f"batch_{secrets.token_hex(16)}", endpoint=body.endpoint,
                  input_file_id=file.id, completion_window=body.completion_window,
                  status="validating", created_at=now,
                  expires_at=now + int(request.app.state.settings.batch_expiry),
                  metadata=body.metadata)
    await store.add_batch(owner, batch)
    batch_runner(request).wake()
    return JSONResponse(batch.model_dump())


async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    return JSONResponse((await batch_store(request).get_batch(owner_of(request), batch_id)).model_dump())


async def list_batches(request: Request, after: str | None = None,
                       limit: int = DEFAULT_LIST_LIMIT) -> JSONResponse:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidRequestError(f"Invalid value for 'limit': it must be between 1 and "
                                  f"{MAX_LIST_LIMIT}.", param="limit")
    batches, more = await batch_store(request).list_batches(owner_of(request), after=after, limit=limit)
    return JSONResponse(BatchList(data=batches, first_id=batches[0].id if batches else None,
                                  last_id=batches[-1].id if batches else None,
                                  has_more=more).model_dump())


async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    store, owner = batch_store(request), owner_of(request)
    batch = await store.get_batch(owner, batch_id)
    # Every write of a batch changes its status and is made only over the status it was read
    # with, so the status is its version: a runner's move in between makes this one retry.
    while batch.status in _CANCELLABLE:
        cancelling = batch.model_copy(update={"status": "cancelling", "cancelling_at": int(time.time())})
        if await store.save_batch(cancelling, only_if=(batch.status,)):
            batch_runner(request).cancel(batch_id)
        batch = await store.get_batch(owner, batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise ConflictError(f"Cannot cancel a batch with status '{batch.status}'.")
    return JSONResponse(batch.model_dump())
