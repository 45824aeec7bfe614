"""One JSON body parser for every service (controller, worker, gateway).

A body is read by pydantic's own JSON parser, so every service takes the same JSON: no lone
surrogate escapes, no invalid UTF-8, nesting at most pydantic's limit, a body that is not JSON or
not a JSON object refused. Any problem is an :class:`~llmplatform.errors.InvalidRequestError`
naming the field at fault (``param``, as ``messages[0].content``); each service turns it into its
own envelope at its edge (the gateway OpenAI's, the worker a FastChat error object, the
controller ``{"error": message}``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from llmplatform.errors import InvalidRequestError

M = TypeVar("M", bound=BaseModel)

_EMPTY = "The request body is empty; expected a JSON object."


def parse_json_body(model: type[M], raw: bytes) -> M:
    """`raw` read and validated as `model` in one pass (pydantic's JSON mode)."""
    if not raw.strip():
        raise InvalidRequestError(_EMPTY)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise body_error(exc) from None


def read_json_body(raw: bytes) -> Any:
    """`raw` as a JSON value, read as :func:`parse_json_body` reads it, for a service that passes
    the body on (the controller relays a worker's params dict whole)."""
    if not raw.strip():
        raise InvalidRequestError(_EMPTY)
    try:
        return from_json(raw)
    except ValueError as exc:
        raise InvalidRequestError(_unparsable(str(exc))) from None


def validate_body(model: type[M], data: Any) -> M:
    """A value :func:`read_json_body` returned, validated as `model`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise body_error(exc) from None


def body_error(exc: ValidationError) -> InvalidRequestError:
    """Pydantic's first complaint about a body, as the client's mistake."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return InvalidRequestError(_unparsable(first["msg"]))
    param = param_path(first["loc"])
    if not param:
        return InvalidRequestError(f"The request body must be a JSON object: {first['msg']}.")
    if first["type"] == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'.", param=param)
    return InvalidRequestError(f"Invalid value for '{param}': {first['msg']}.", param=param)


def _unparsable(reason: str) -> str:
    return f"We could not parse the JSON body of your request: {reason}. The body must be valid JSON."


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def param_path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "content", "str")`` -> ``"messages[0].content"``.

    Pydantic adds union members (``str``, ``list[int]``) and model names to locations; those are
    dropped so the path names what the client sent.
    """
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper() or "-" in part:
            continue
        else:
            path += f".{part}" if path else part
    return path
