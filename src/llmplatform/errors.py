"""Typed errors shared by every layer.

A client mistake (:class:`InvalidRequestError` and subclasses) is never a 500 and never kills the
engine; an :class:`EngineDeadError` means the backend cannot serve any more. Translation to
FastChat error codes and to OpenAI's error envelope happens once, at each HTTP edge, from the
``error_code`` / ``http_status`` / ``openai_type`` carried here.
"""

from __future__ import annotations


class ErrorCode:
    """FastChat's numeric error codes (they travel inside worker streams)."""

    VALIDATION_TYPE_ERROR = 40001
    INVALID_AUTH_KEY = 40101
    INCORRECT_AUTH_KEY = 40102
    INVALID_MODEL = 40301
    PARAM_OUT_OF_RANGE = 40302
    CONTEXT_OVERFLOW = 40303
    RATE_LIMIT = 42901
    QUOTA_EXCEEDED = 42902
    ENGINE_OVERLOADED = 42903
    INTERNAL_ERROR = 50001
    CUDA_OUT_OF_MEMORY = 50002
    GRADIO_REQUEST_ERROR = 50003
    GRADIO_STREAM_UNKNOWN_ERROR = 50004
    CONTROLLER_NO_WORKER = 50005
    CONTROLLER_WORKER_TIMEOUT = 50006


class LLMPlatformError(Exception):
    """Base of every error we raise on purpose."""

    error_code: int = ErrorCode.INTERNAL_ERROR
    http_status: int = 500
    openai_type: str = "internal_error"
    openai_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(LLMPlatformError, ValueError):
    """The request is malformed or a parameter is out of range (HTTP 400)."""

    error_code = ErrorCode.PARAM_OUT_OF_RANGE
    http_status = 400
    openai_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested output cannot fit in the model's context (HTTP 400)."""

    error_code = ErrorCode.CONTEXT_OVERFLOW
    openai_code = "context_length_exceeded"


class PayloadTooLargeError(LLMPlatformError):
    """The request body is over the service's size cap (HTTP 413)."""

    error_code = ErrorCode.PARAM_OUT_OF_RANGE
    http_status = 413
    openai_type = "invalid_request_error"
    openai_code = "request_too_large"

    @classmethod
    def over(cls, max_bytes: int) -> PayloadTooLargeError:
        return cls(f"The request body is too large: this service accepts at most {max_bytes} bytes.")


class ModelNotFoundError(LLMPlatformError):
    """No such model is served (HTTP 404)."""

    error_code = ErrorCode.INVALID_MODEL
    http_status = 404
    openai_type = "invalid_request_error"
    openai_code = "model_not_found"


class ConflictError(LLMPlatformError):
    """The request conflicts with what exists: a model launched twice, or a launch that does not
    fit the host's free memory (HTTP 409)."""

    error_code = ErrorCode.PARAM_OUT_OF_RANGE
    http_status = 409
    openai_type = "invalid_request_error"
    openai_code = "conflict"


class EngineOverloadedError(LLMPlatformError):
    """The backend cannot take the request now; retry later (HTTP 429)."""

    error_code = ErrorCode.ENGINE_OVERLOADED
    http_status = 429
    openai_type = "rate_limit_error"


class EngineDeadError(LLMPlatformError):
    """The backend failed and cannot serve any more (HTTP 503)."""

    error_code = ErrorCode.INTERNAL_ERROR
    http_status = 503
    openai_type = "service_unavailable"


class EngineRestartingError(EngineDeadError):
    """The backend failed as a whole and is rebuilding itself: the request was lost, or cannot
    start until the rebuild is done; retrying it is safe (HTTP 503)."""


class NoWorkerError(LLMPlatformError):
    """The controller knows no live worker for the model (HTTP 503)."""

    error_code = ErrorCode.CONTROLLER_NO_WORKER
    http_status = 503
    openai_type = "service_unavailable"


class WorkerTimeoutError(LLMPlatformError):
    """A worker did not answer in time (HTTP 504)."""

    error_code = ErrorCode.CONTROLLER_WORKER_TIMEOUT
    http_status = 504
    openai_type = "timeout"


_BY_CODE: dict[int, type[LLMPlatformError]] = {
    ErrorCode.VALIDATION_TYPE_ERROR: InvalidRequestError,
    ErrorCode.PARAM_OUT_OF_RANGE: InvalidRequestError,
    ErrorCode.CONTEXT_OVERFLOW: ContextLengthExceededError,
    ErrorCode.INVALID_MODEL: ModelNotFoundError,
    ErrorCode.RATE_LIMIT: EngineOverloadedError,
    ErrorCode.ENGINE_OVERLOADED: EngineOverloadedError,
    ErrorCode.CONTROLLER_NO_WORKER: NoWorkerError,
    ErrorCode.CONTROLLER_WORKER_TIMEOUT: WorkerTimeoutError,
}


def error_from_code(error_code: int, message: str, param: str | None = None) -> LLMPlatformError:
    """Rebuild a typed error from a FastChat error code found in a worker stream (``param``: the
    field it names, when the worker said)."""
    cls = _BY_CODE.get(error_code, LLMPlatformError)
    return cls(message, param=param)
