"""OpenAI's Files and Batch APIs (``/v1/files``, ``/v1/batches``) as the gateway speaks them:
contracts only (the routes are openai_api.files and openai_api.batches)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
"""What a client may upload a file for (OpenAI's list). Only ``batch`` files are used here; the
rest are kept and served back, as OpenAI's Files API does for any purpose."""
BATCH_OUTPUT_PURPOSE = "batch_output"
"""The purpose of a batch's output and error files (written by the gateway, never uploaded)."""

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""The endpoints a batch may run (OpenAI's list, less the ones this platform does not serve)."""
COMPLETION_WINDOWS = ("24h",)

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
ACTIVE_STATUSES: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
"""The statuses the runner still has work for (every other one is final)."""


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    """Deprecated by OpenAI; a stored file is ``processed``."""
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: StrictStr
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    """Up to 16 pairs, keys of at most 64 characters, values of at most 512 (OpenAI's limits;
    checked in openai_api.batches, which names the key at fault)."""


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None
    """The input file's line (1-based) at fault, if one is."""


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    """Lines answered with a 2xx (in the output file)."""
    failed: int = 0
    """Lines answered with an error (in the error file). Lines a cancel or the expiry left
    unrun are in the error file too, but counted in neither."""


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    """The model every line asks for (set once the input is validated)."""
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = BatchRequestCounts()
    usage: BatchUsage = BatchUsage()
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchInputLine(BaseModel):
    """One line of a batch's input file."""

    model_config = ConfigDict(extra="ignore", strict=True)

    custom_id: StrictStr = Field(min_length=1, max_length=512)
    method: StrictStr
    url: StrictStr
    body: dict[str, Any]


class BatchLineResponse(BaseModel):
    status_code: int
    request_id: str
    body: Any


class BatchLineError(BaseModel):
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of a batch's output file (answered 2xx) or error file (answered otherwise:
    ``response`` carries the error envelope; or not run at all: ``error`` says why)."""

    id: str
    custom_id: str
    response: BatchLineResponse | None = None
    error: BatchLineError | None = None
