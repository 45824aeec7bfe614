"""What a peer (a worker, a controller) said, made fit to show a client.

A worker is reached at an address someone registered, and it may be broken, stock or hostile:
whatever it answers must not travel to API clients as it is (an HTML error page, a stack trace,
a body crafted to mislead the reader of an error message, megabytes of it). Two rules, shared by
the gateway and the controller's stream proxy:

- a well-formed FastChat error (`{"text": str, "error_code": int}` with one of FastChat's codes,
  `llmplatform.errors.ErrorCode`) keeps its text, as the worker's own explanation of a refusal,
  cut to `MAX_PEER_TEXT_CHARS` and stripped of control characters;
- anything else (a non-200 answer in another shape, an unknown code, a frame that is not JSON) is
  described, never quoted: "answered with an invalid response" and the HTTP status.
"""

from __future__ import annotations

from llmplatform.errors import ErrorCode

MAX_PEER_TEXT_CHARS = 500
"""The most characters of a peer's error text passed on."""

KNOWN_ERROR_CODES = frozenset(
    value for name, value in vars(ErrorCode).items() if name.isupper() and isinstance(value, int)
)


def is_known_error_code(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in KNOWN_ERROR_CODES


def safe_peer_text(text: str, limit: int = MAX_PEER_TEXT_CHARS) -> str:
    """`text` without control characters (newlines and tabs become spaces), at most `limit`
    characters (an ellipsis marks a cut)."""
    cleaned = "".join(ch if ch.isprintable() else " " for ch in text[: limit + 1]).strip()
    if len(cleaned) > limit:
        cleaned = cleaned[: limit - 1].rstrip() + "…"
    return cleaned


def invalid_response(who: str, status: int | None = None) -> str:
    """The message for an answer that is not shown: `who` ("The worker at URL") and its status."""
    suffix = f" (HTTP {status})" if status is not None else ""
    return f"{who} answered with an invalid response{suffix}."
