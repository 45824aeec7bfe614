"""The worker protocol on the wire, as the gateway reads it: NUL-delimited JSON frames, and every
failure as a typed error that says what it allows (see :func:`may_try_another_worker`).

An unreachable peer is 503 (:class:`WorkerUnavailableError` for a worker: another may take the
request), a silent one 504, a worker's FastChat error code keeps its meaning
(:func:`llmplatform.errors.error_from_code`), a 429 keeps its ``Retry-After``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping

import httpx
from pydantic import ValidationError

from llmplatform.errors import (
    EngineOverloadedError,
    LLMPlatformError,
    NoWorkerError,
    WorkerTimeoutError,
    error_from_code,
)
from llmplatform.openai_api.errors import UpstreamError, error_from_http
from llmplatform.protocol.worker import NUL, WorkerChunk
from llmplatform.utils.peer_text import is_known_error_code, safe_peer_text

_MAX_RETRY_AFTER_S = 3600


class WorkerUnavailableError(NoWorkerError):
    """A worker could not take the request and generated nothing for it (unreachable, closed
    the connection before answering, dead engine, shutting down): another worker may (503)."""


MAX_WORKER_FRAME_BYTES = 16 * 2**20
"""The largest stream frame the gateway takes from a worker (16 MiB). A delta frame (what our
workers send: a few tokens with their logprobs) is well under a kilobyte; a cumulative frame (a
stock FastChat worker, or ``--no-worker-stream-deltas``) carries the whole answer so far, which
with 20 logprobs per token reaches this size only past ~25,000 tokens. A worker that sends more
without a NUL fails that request (502), and the gateway never holds more than this (plus one
read) for one stream."""


class FrameTooLargeError(UpstreamError):
    """A worker's stream frame passed :data:`MAX_WORKER_FRAME_BYTES` (HTTP 502)."""


class NulFrameDecoder:
    """Splits a byte stream into NUL-terminated frames, whatever the read boundaries.

    Each byte is searched for a NUL once: ``_buffer`` holds the unfinished frame, whose bytes
    are known to hold no NUL, so a read is scanned from where the previous one ended. A frame is
    copied once, when it is complete; the consumed prefix is dropped with ``del`` (CPython's
    bytearray moves its start instead of copying the rest). So a frame trickled in byte by byte
    costs linear time, not the quadratic copy-and-split of the whole buffer per read."""

    def __init__(self, max_frame_bytes: int = MAX_WORKER_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        scan = len(buffer)  # what is already buffered holds no NUL
        buffer += data
        frames: list[bytes] = []
        start = 0
        end = buffer.find(NUL, scan)
        if end >= 0:
            with memoryview(buffer) as view:  # released before the buffer is resized
                while end >= 0:
                    self._check(end - start)
                    frame = view[start:end].tobytes()
                    if frame.strip():
                        frames.append(frame)
                    start = end + 1
                    end = buffer.find(NUL, start)
            del buffer[:start]
        self._check(len(buffer))
        return frames

    def _check(self, size: int) -> None:
        if size > self._max_frame_bytes:
            self._buffer = bytearray()  # the stream is abandoned: drop what it sent at once
            raise FrameTooLargeError(
                f"The worker sent a stream frame larger than {self._max_frame_bytes} bytes "
                "(the gateway's limit for one frame); the request is abandoned.")

    def flush(self) -> bytes | None:
        """An unterminated last frame, if the stream ended with one."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        return rest if rest.strip() else None


def parse_chunk(frame: bytes) -> WorkerChunk:
    """One frame as a chunk; a FastChat error object raises its typed error. What the worker
    sent is shown to the client only as a known FastChat error's text, cut short (see
    utils.peer_text): a malformed frame or an unknown code is described, never quoted."""
    try:
        chunk = WorkerChunk.model_validate_json(frame)  # one pass, in pydantic's own JSON parser
    except (ValueError, ValidationError):
        raise UpstreamError("The worker answered with an invalid response (a malformed stream chunk).") from None
    if chunk.error_code and not is_known_error_code(chunk.error_code):
        raise UpstreamError("The worker answered with an invalid response (an unknown error code).")
    if chunk.error_code:
        raise error_from_code(chunk.error_code, safe_peer_text(chunk.text) or f"worker error {chunk.error_code}",
                              chunk.param)
    return chunk


@contextlib.contextmanager
def transport_errors(peer: str, url: str, timeout: float) -> Iterator[None]:
    unavailable = WorkerUnavailableError if peer == "worker" else NoWorkerError
    try:
        yield
    except httpx.ConnectTimeout:
        raise unavailable(f"The {peer} at {url} did not accept a connection in time.") from None
    except httpx.TimeoutException:
        raise WorkerTimeoutError(f"The {peer} at {url} did not answer within {timeout:g} s.") from None
    except httpx.HTTPError as exc:
        # Refused, reset, or closed before any answer: the peer is gone (or going).
        raise unavailable(f"The {peer} at {url} is unreachable ({type(exc).__name__}).") from None


def _retry_after(value: str | None) -> int | None:
    """Retry-After in seconds (the HTTP-date form is not used by workers), capped."""
    try:
        seconds = int(value) if value is not None else None
    except ValueError:
        return None
    return None if seconds is None or seconds < 0 else min(seconds, _MAX_RETRY_AFTER_S)


def worker_http_error(status: int, headers: Mapping[str, str], body: bytes, what: str) -> LLMPlatformError:
    """A typed error for a worker's non-200 answer (``headers`` looked up by lower-case name:
    httpx's are case-insensitive, worker_stream's lower-cased); 503 and 429 keep the meaning
    retries need."""
    error = error_from_http(status, body, what)
    if status == 503:
        return WorkerUnavailableError(error.message)
    if status == 429:
        if not isinstance(error, EngineOverloadedError):
            error = EngineOverloadedError(error.message)
        error.retry_after = _retry_after(headers.get("retry-after"))  # type: ignore[attr-defined]
    return error


def may_try_another_worker(error: LLMPlatformError) -> bool:
    """True for failures that leave the request undone and another worker able to do it."""
    return isinstance(error, (WorkerUnavailableError, EngineOverloadedError))


def has_error_code(body: bytes) -> bool:
    """Whether a body is a FastChat error object (``error_code`` set): a worker's own 404 answer,
    not a missing route."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and bool(data.get("error_code"))


class Accepted:
    """The type of :data:`ACCEPTED`."""

    def __repr__(self) -> str:
        return "ACCEPTED"


ACCEPTED = Accepted()
"""What ``WorkerClient.generate_stream`` yields first when the worker has checked the request."""
