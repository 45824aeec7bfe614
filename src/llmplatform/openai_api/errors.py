"""The gateway's one translation of errors to OpenAI's envelope and HTTP status.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}``. Typed errors
(:mod:`llmplatform.errors`) carry their own status and type; request parsing failures are 400
with ``param`` naming the field; anything unexpected is a logged 500 and the server keeps going.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmplatform.errors import ErrorCode, InvalidRequestError, LLMPlatformError, error_from_code
from llmplatform.protocol.openai import ErrorResponse
from llmplatform.utils.json_body import param_path
from llmplatform.utils.peer_text import invalid_response, is_known_error_code, safe_peer_text

logger = logging.getLogger("llmplatform.openai_api")


class AuthenticationError(LLMPlatformError):
    """Missing or wrong API key (HTTP 401)."""

    error_code = ErrorCode.INVALID_AUTH_KEY
    http_status = 401
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"


class PermissionDeniedError(LLMPlatformError):
    """A valid API key without the right to this route (HTTP 403)."""

    error_code = ErrorCode.INVALID_AUTH_KEY
    http_status = 403
    openai_type = "invalid_request_error"
    openai_code = "insufficient_permissions"


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; nobody is left to answer."""


_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class UpstreamError(LLMPlatformError):
    """A worker or the controller answered 5xx without a FastChat error code (HTTP 502)."""

    http_status = 502
    openai_type = "api_error"


def error_payload(exc: LLMPlatformError) -> dict[str, Any]:
    """The envelope for a typed error (also sent as an SSE event once a stream has begun)."""
    return ErrorResponse.of(
        exc.message, exc.openai_type, param=exc.param, code=exc.openai_code
    ).model_dump()


def error_response(exc: LLMPlatformError) -> JSONResponse:
    # A worker's 429 carries Retry-After (`retry_after`, seconds); the client gets it too.
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_payload(exc), status_code=exc.http_status, headers=headers)


def error_from_http(status_code: int, body: bytes, what: str) -> LLMPlatformError:
    """A typed error for a non-200 answer from a worker or the controller.

    Only a well-formed FastChat error object (``{"text": message, "error_code": code}`` with one
    of FastChat's codes: what our worker and FastChat's answer) passes its text on, cut short and
    without control characters (:mod:`llmplatform.utils.peer_text`). Anything else a peer sent is
    never quoted to the client: the error says it answered with an invalid response, and its
    status alone picks the error's type.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict) and data.get("error_code"):
        code, text = data.get("error_code"), data.get("text")
        if is_known_error_code(code) and isinstance(text, str) and safe_peer_text(text):
            error = error_from_code(code, safe_peer_text(text))
            param = data.get("param")
            if isinstance(param, str) and 0 < len(param) <= 128 and param.isprintable():
                error.param = param
            return error
    message = invalid_response(what, status_code)
    if 400 <= status_code < 500:
        return InvalidRequestError(message)
    return UpstreamError(message)


def _internal_error_response() -> JSONResponse:
    body = ErrorResponse.of("The server had an error while processing your request.", "internal_error")
    return JSONResponse(body.model_dump(), status_code=500)


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def guard(handler: Handler) -> Handler:
    """`handler`, answering every exception it raises with an envelope response itself.

    Starlette answers an unhandled exception with a 500 and then re-raises it, so uvicorn drops
    the (keep-alive) connection; a client's next request on it would fail. Catching here keeps
    the connection usable. The app-level handlers below remain as a backstop.
    """

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except LLMPlatformError as exc:
            _log_typed(request, exc)
            return error_response(exc)
        except ClientDisconnected:
            return _disconnected_response(request)
        except (StarletteHTTPException, RequestValidationError):
            raise
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.url.path)
            return _internal_error_response()

    return guarded


class EnvelopeRoute(APIRoute):
    """A route whose handler answers its own exceptions with an envelope (see `guard`)."""

    def get_route_handler(self) -> Handler:
        return guard(super().get_route_handler())


def _log_typed(request: Request, exc: LLMPlatformError) -> None:
    if exc.http_status >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.http_status, exc.message)


def _disconnected_response(request: Request) -> Response:
    logger.info("%s %s: client disconnected; request aborted", request.method, request.url.path)
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(LLMPlatformError)
    async def _typed(request: Request, exc: LLMPlatformError) -> JSONResponse:
        _log_typed(request, exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param = param_path(tuple(errors[0]["loc"][1:])) if errors else None
        message = errors[0]["msg"] if errors else "invalid request"
        return error_response(InvalidRequestError(f"Invalid request: {message}", param=param or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse.of(
            str(exc.detail), _STATUS_TYPES.get(exc.status_code, "api_error"), code=None
        ).model_dump()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return _disconnected_response(request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return _internal_error_response()
