"""OpenAI's Files API: ``/v1/files`` (upload, list), ``/v1/files/{id}`` (retrieve, delete) and
``/v1/files/{id}/content``.

An upload is a multipart form (``file``, ``purpose``). The body guard (openai_api.limits) counts
it as it arrives and fails the read past the cap, Starlette's form parser spools the file to a
temporary file (in memory only up to 1 MiB), and it is copied into the files folder on a
thread, its size checked again exactly. Contents are served from disk in chunks. Every file is
its uploader's alone (openai_api.batch_store); batch output files are their batch's owner's.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import IO

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile

from llmplatform.errors import InvalidRequestError, PayloadTooLargeError
from llmplatform.openai_api.batch_store import BatchStore
from llmplatform.openai_api.tenants import owner_of
from llmplatform.protocol.batches import UPLOAD_PURPOSES, FileDeleted, FileList, FileObject

FILES_PATH = "/v1/files"
MAX_LIST_LIMIT = 10_000
"""Most files one page lists (OpenAI's limit and default)."""
UPLOAD_OVERHEAD_BYTES = 64 * 1024
"""What a multipart body may carry beyond the file itself (boundaries, part headers, purpose)."""
_COPY_CHUNK = 1024 * 1024


def batch_store(request: Request) -> BatchStore:
    return request.app.state.batch_store


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


async def create_file(request: Request) -> JSONResponse:
    settings = request.app.state.settings
    store = batch_store(request)
    form = await request.form(max_files=1, max_fields=8)
    file_id = new_file_id()
    path = store.file_path(file_id)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("Missing required parameter: 'file'.", param="file")
        if not isinstance(purpose, str) or not purpose:
            raise InvalidRequestError("Missing required parameter: 'purpose'.", param="purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequestError(
                f"Invalid value for 'purpose': {purpose[:40]!r} is not one of "
                f"{', '.join(UPLOAD_PURPOSES)}.", param="purpose")
        size = await asyncio.to_thread(_copy_into, upload.file, path, settings.max_upload_bytes)
    finally:
        await form.close()
    file = FileObject(id=file_id, bytes=size, created_at=int(time.time()),
                      filename=(upload.filename or "upload")[:256], purpose=purpose)
    try:
        await store.add_file(owner_of(request), file)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return JSONResponse(file.model_dump())


def _copy_into(source: IO[bytes], path: Path, max_bytes: int) -> int:
    """Copy `source` to `path` (through a ``.part`` file, renamed when whole); its size. Over
    `max_bytes` is a 413 and nothing is left behind."""
    partial = path.with_name(path.name + ".part")
    source.seek(0)
    size = 0
    try:
        with open(os.open(partial, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "wb") as out:
            while chunk := source.read(_COPY_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLargeError.over(max_bytes)
                out.write(chunk)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return size


async def list_files(request: Request, purpose: str | None = None, limit: int = MAX_LIST_LIMIT,
                     order: str = "desc", after: str | None = None) -> JSONResponse:
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidRequestError(f"Invalid value for 'limit': it must be between 1 and "
                                  f"{MAX_LIST_LIMIT}.", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("Invalid value for 'order': it must be 'asc' or 'desc'.", param="order")
    files, more = await batch_store(request).list_files(
        owner_of(request), purpose=purpose, after=after, limit=limit, newest_first=order == "desc")
    return JSONResponse(FileList(data=files, first_id=files[0].id if files else None,
                                 last_id=files[-1].id if files else None,
                                 has_more=more).model_dump())


async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    return JSONResponse((await batch_store(request).get_file(owner_of(request), file_id)).model_dump())


async def retrieve_file_content(file_id: str, request: Request) -> FileResponse:
    store = batch_store(request)
    await store.get_file(owner_of(request), file_id)  # its owner's only
    return FileResponse(store.file_path(file_id), media_type="application/octet-stream")


async def delete_file(file_id: str, request: Request) -> JSONResponse:
    await batch_store(request).delete_file(owner_of(request), file_id)
    return JSONResponse(FileDeleted(id=file_id).model_dump())

