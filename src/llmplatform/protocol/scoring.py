"""``/v1/rerank`` and ``/v1/score`` as the gateway speaks them (contracts only).

Rerank is Jina's and Cohere's shape (vLLM, SGLang and llama.cpp serve it too): a ``query``, its
``documents`` (strings, or objects with a ``text``), ``top_n`` and ``return_documents``; the
answer's ``results`` sorted by ``relevance_score``, each with the document's ``index``. Score is
vLLM's: ``text_1`` against ``text_2``, each a string or a list. Parsed as the OpenAI requests are
(strict JSON, unknown fields ignored), except the fields other servers define that would change
the answer and are not served here: those are refused by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class RerankDocument(BaseModel):
    """A document given as an object: its ``text`` is ranked; other keys are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    text: str


class RerankRequest(_Request):
    """``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``, as vLLM serves it)."""

    model: str
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    """The best N results only; None or 0 (vLLM's default): all of them."""
    return_documents: bool = True
    """Each result carries its ``document`` (``{"text"}``), as Jina and vLLM answer by default."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """*extension* (vLLM's): cut a longer pair to this many tokens (-1: the model's limit)
    instead of refusing it."""
    user: str | None = None
    # Cohere's, not served: refused by name when given (``unserved``).
    rank_fields: Any = None
    max_chunks_per_doc: Any = None
    max_tokens_per_doc: Any = None

    def unserved(self) -> str | None:
        """The first field given that this gateway does not serve."""
        return next((name for name in ("rank_fields", "max_chunks_per_doc", "max_tokens_per_doc")
                     if getattr(self, name) is not None), None)


class ScoreRequest(_Request):
    """``POST /v1/score`` (also ``/score``): vLLM's. One ``text_1`` against one or many
    ``text_2``, or lists of the same length scored pairwise."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None
