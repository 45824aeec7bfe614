"""Logging shared by every service: one line per event (text or JSON), each line about a request
tagged with its request id. (Every service's ``--log-level`` / ``--log-format`` settings are
declared once, in ``service_settings.LoggingSettings``.)

The request id travels in a :class:`contextvars.ContextVar`: whoever handles a request sets it
(:func:`request_context`), and a log-record factory copies it onto every record created while it
is set, whatever the logger or handler (uvicorn's access lines and pytest's ``caplog`` included).
Code that logs about a request from elsewhere (the engine's step loop) sets it around the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOG_FORMATS = ("text", "json")

# Routes polled every few seconds (heartbeats, health checks, scrapes, the gateways' routing-table
# reads every second): logging each call would bury everything else.
_QUIET_PATHS = ("/receive_heart_beat", "/health", "/worker_get_status", "/metrics", "/list_workers")

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmplatform_request_id",
                                                                        default=None)
"""The id of the request being handled in this context (None outside any request)."""

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is data.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "request_id", "taskName",
    "color_message"}  # uvicorn's ANSI-coloured copy of the message

T = TypeVar("T")


def current_request_id() -> str | None:
    return REQUEST_ID.get()


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Tag every log line created inside the block with ``request_id``."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


def install_request_id_logging() -> None:
    """Make every LogRecord carry ``request_id`` (the context's, or None). Idempotent.

    A record factory rather than a handler filter: filters on one handler miss records that
    other handlers (a test's ``caplog``, a library's own) see, and the id must be read where the
    record is created, in the request's context, not where it is formatted.
    """
    current = logging.getLogRecordFactory()
    if getattr(current, "_llmplatform_request_id", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = current(*args, **kwargs)
        record.request_id = REQUEST_ID.get()
        return record

    factory._llmplatform_request_id = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


class _DropPollingRequests(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn.access records carry (client, method, path, http_version, status).
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return not args[2].startswith(_QUIET_PATHS)
        return True


def _one_line(text: str) -> str:
    # One event, one line: a traceback or a multi-line message must not split a record in two.
    return text.replace("\r", "\\r").replace("\n", "\\n")


class TextFormatter(logging.Formatter):
    """``2026-01-01 12:00:00,000 INFO llmplatform.worker [req-id] message key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        request_id = getattr(record, "request_id", None)
        line = f"{self.formatTime(record)} {record.levelname} {record.name}"
        if request_id:
            line += f" [{request_id}]"
        line += f": {record.message}"
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info)
        elif record.stack_info:
            line += " | " + self.formatStack(record.stack_info)
        return _one_line(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, ``request_id`` when
    the line is about a request, ``exc_info`` for a traceback, plus any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            out["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes, not the one at set-up: code that
    swaps stderr (pytest's capture, a redirect) must not leave us writing to a closed file."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_log_format = "text"


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    """Send every log record (ours, uvicorn's, libraries') to stderr in one format.

    Replaces the handler a previous call installed, so a service may reconfigure after parsing
    its flags. Uvicorn must then be started with ``log_config=None`` (see
    :func:`uvicorn_log_options`) or it installs its own handlers and format.
    """
    global _log_format
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    _log_format = log_format
    install_request_id_logging()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_llmplatform", False):
            root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler._llmplatform = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Python warnings become log records too (one line, in the chosen format).
    logging.captureWarnings(True)
    if log_format == "json":
        # Progress bars are not log lines: they would break one-JSON-object-per-line output.
        with contextlib.suppress(Exception):
            from huggingface_hub.utils import disable_progress_bars
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            disable_progress_bars()
    # httpx logs every request at INFO (heartbeats included); keep its warnings only.
    if root.level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, _DropPollingRequests) for f in access.filters):
            access.addFilter(_DropPollingRequests())


def uvicorn_log_options(level: str) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` that keep the logging :func:`configure_logging` set
    up (uvicorn's records then propagate to our handler, in our format)."""
    return {"log_config": None, "log_level": level.lower()}


def progress(iterable: Iterable[T], *, total: int | None, desc: str, unit: str = "it") -> Iterable[T]:
    """``iterable`` with a progress bar on stderr, for slow steps at startup (loading weights).

    Shown on a terminal only, never with JSON logs; ``LLMPLATFORM_PROGRESS=1`` (or ``0``) forces
    it on (off).
    """
    forced = os.environ.get("LLMPLATFORM_PROGRESS", "").strip()
    if forced in ("0", "1"):
        disable: bool | None = forced == "0"
    else:
        disable = True if _log_format == "json" else None  # None: tqdm shows it on a TTY only
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr,
                dynamic_ncols=True)


def log_summary(logger: logging.Logger, title: str, fields: dict[str, Any]) -> None:
    """One line that says what a service is and where: ``title: key=value key=value ...``.

    In JSON mode the same fields also arrive as a ``summary`` object, for machines.
    """
    text = " ".join(f"{key}={value}" for key, value in fields.items())
    logger.info("%s: %s", title, text, extra={"summary": fields})
