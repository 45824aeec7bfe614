"""A batch's input file, checked as OpenAI checks it before a batch starts.

Each non-blank line must be a JSON object ``{"custom_id", "method": "POST", "url", "body"}``
with ``url`` the batch's endpoint, a ``custom_id`` no other line has, and a ``body`` naming the
same ``model`` as every other line; at most ``max_requests`` lines, and at least one. A file
that breaks any of these fails the batch (``status: failed``) with one error per line at fault
(``errors.data``: ``code``, ``message``, ``param``, ``line``), as OpenAI reports them
(``invalid_json_line``, ``invalid_request``, ``url_mismatch``, ``duplicate_custom_id``,
``model_mismatch``, ``too_many_tasks``, ``empty_file``). What the body asks for is checked only
when the line runs, by the endpoint itself: a line it refuses goes to the error file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from llmplatform.openai_api.batch_store import PendingLine
from llmplatform.protocol.batches import BatchError, BatchInputLine
from llmplatform.utils.json_body import body_error

MAX_REPORTED_ERRORS = 100
"""Errors one failed batch reports at most (a file of bad lines would otherwise yield one each)."""


@dataclass
class CheckedInput:
    lines: list[PendingLine] = field(default_factory=list)
    model: str | None = None
    errors: list[BatchError] = field(default_factory=list)


def check_input(path: Path, endpoint: str, max_requests: int) -> CheckedInput:
    """Read and check the input file at `path` (on a thread: it may be 200 MB)."""
    checked = CheckedInput()
    seen: set[str] = set()
    count = 0

    def fail(code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(checked.errors) < MAX_REPORTED_ERRORS:
            checked.errors.append(BatchError(code=code, message=message, param=param, line=line))

    with open(path, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if not raw.strip():
                continue
            count += 1
            if count > max_requests:
                fail("too_many_tasks", f"The batch input file has more than {max_requests} "
                     "requests; split it into several batches.", None)
                break
            request = _parse(raw, number, fail)
            if request is None:
                continue
            if request.method != "POST":
                fail("invalid_request", f"The method must be 'POST', got {request.method[:16]!r}.",
                     number, "method")
            elif request.url != endpoint:
                fail("url_mismatch", f"The url {request.url[:64]!r} does not match the batch's "
                     f"endpoint {endpoint!r}.", number, "url")
            elif request.custom_id in seen:
                fail("duplicate_custom_id", f"The custom_id {request.custom_id[:64]!r} is used by "
                     "another line; each line's custom_id must be unique.", number, "custom_id")
            elif not isinstance(request.body.get("model"), str):
                fail("invalid_request", "Missing required parameter: 'body.model'.", number, "body.model")
            elif checked.model is not None and request.body["model"] != checked.model:
                fail("model_mismatch", f"The model {request.body['model'][:64]!r} differs from "
                     f"the batch's ({checked.model!r}); a batch runs one model.", number, "body.model")
            else:
                seen.add(request.custom_id)
                checked.model = request.body["model"]
                checked.lines.append(PendingLine(number, request.custom_id,
                                                 request.model_dump_json()))
    if count == 0:
        fail("empty_file", "The batch input file is empty.", None)
    return checked


def _parse(raw: bytes, number: int, fail) -> BatchInputLine | None:
    try:
        data = json.loads(raw)
    except ValueError:
        fail("invalid_json_line", "This line is not parseable as valid JSON.", number)
        return None
    if not isinstance(data, dict):
        fail("invalid_json_line", "This line is not a JSON object.", number)
        return None
    try:
        return BatchInputLine.model_validate(data)
    except ValidationError as exc:
        error = body_error(exc)
        fail("invalid_request", error.message, number, error.param)
        return None
