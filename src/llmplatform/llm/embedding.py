"""The embedding side of the backend interface: what a model serves, and what an embedding is.

A backend states in its :class:`~llmplatform.llm.base.ModelFacts` which :class:`ModelTask` s it
serves (``tasks``) and, when it embeds, its :class:`EmbeddingFacts`. One that embeds implements

    async def embed(self, token_id_lists: Sequence[Sequence[int]], *,
                    request_id: str | None = None) -> list[EmbeddingResult]

(:meth:`~llmplatform.llm.base.LLMBackend.embed`): each list is one input's complete token ids
(the model's special tokens included, as :meth:`embedding_token_ids_sync` makes them, already
within ``max_input_tokens``), and each result is that input's pooled vector in the same order,
float32, normalized when the model's own pipeline normalizes. Which inputs run together is the
backend's business (cross-request batching); a vector must not depend on it.

Inputs are checked here, once, for every backend (:func:`prepare_inputs`): an input over the
model's length is a ``context_length_exceeded`` error unless the request asked for truncation
(``truncate_prompt_tokens``, as vLLM names it), and then it is cut by the tokenizer's rules.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmplatform.errors import ContextLengthExceededError, InvalidRequestError


class ModelTask(str, enum.Enum):
    """What a backend serves: ``generate`` (chat and completions), ``embed`` (embeddings),
    ``score`` (a cross-encoder's relevance of text pairs: rerank and score, ``llm.scoring``)."""

    GENERATE = "generate"
    EMBED = "embed"
    SCORE = "score"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class EmbeddingFacts:
    """An embedding model's output, as workers announce it (``/model_details``)."""

    dimensions: int
    """Width of the vectors."""
    max_input_tokens: int
    """Longest input the model embeds, its special tokens included."""
    normalized: bool
    """Vectors are unit length (the model's pipeline ends with a normalization)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Widths a request may truncate vectors to (``dimensions``): None when the model does not
    support truncation; every width from 1 to ``dimensions`` when its config says
    ``"is_matryoshka": true``, or the listed ones (``"matryoshka_dimensions": [...]``)."""

    def to_wire(self) -> dict[str, Any]:
        return {"dimensions": self.dimensions, "max_input_tokens": self.max_input_tokens,
                "normalized": self.normalized,
                "matryoshka_dimensions": (list(self.matryoshka_dimensions)
                                          if self.matryoshka_dimensions is not None else None)}


@dataclass(frozen=True)
class EmbeddingResult:
    vector: np.ndarray
    """``[dimensions]`` float32."""
    num_tokens: int
    """Tokens the input ran as (after any truncation): its share of ``usage.prompt_tokens``."""


def not_an_embedding_model(model: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"model {model!r} is a generation model and serves no embeddings; use an embedding model "
        "(GET /v1/models lists what each model serves)", param="model")


def check_dimensions(facts: EmbeddingFacts, model: str, dimensions: int | None) -> None:
    """Refuse a ``dimensions`` the model cannot truncate its vectors to (400 naming it)."""
    if dimensions is None:
        return
    allowed = facts.matryoshka_dimensions
    if allowed is None:
        raise InvalidRequestError(
            f"model {model!r} does not support 'dimensions' (its vectors cannot be truncated: "
            f"they have {facts.dimensions} dimensions)", param="dimensions")
    if dimensions < 1 or dimensions > facts.dimensions or (allowed and dimensions not in allowed):
        what = f"one of {list(allowed)}" if allowed else f"between 1 and {facts.dimensions}"
        raise InvalidRequestError(f"'dimensions' must be {what} for model {model!r}, not {dimensions}",
                                  param="dimensions")


def truncate_vector(vector: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """The first ``dimensions`` components (Matryoshka), renormalized when the model's vectors
    are unit length."""
    if dimensions is None or dimensions >= vector.shape[0]:
        return vector
    cut = vector[:dimensions]
    if normalized:
        norm = float(np.linalg.norm(cut))
        if norm > 0:
            cut = cut / norm
    return cut.astype(np.float32, copy=False)


def truncation_limit(truncate_prompt_tokens: int | None, max_input_tokens: int) -> int | None:
    """Tokens an input is cut to: None (not cut: too long is an error); ``-1`` means the
    model's own limit, as in vLLM."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_input_tokens
    if truncate_prompt_tokens < 1:
        raise InvalidRequestError("'truncate_prompt_tokens' must be -1 (the model's limit) or a "
                                  "positive number of tokens", param="truncate_prompt_tokens")
    return min(truncate_prompt_tokens, max_input_tokens)


def cut_token_ids(token_ids: Sequence[int], limit: int, truncation_side: str) -> list[int]:
    """Raw token ids cut to ``limit`` on the tokenizer's truncation side."""
    if len(token_ids) <= limit:
        return list(token_ids)
    return list(token_ids[-limit:]) if truncation_side == "left" else list(token_ids[:limit])


def check_lengths(token_id_lists: Sequence[Sequence[int]], max_input_tokens: int) -> None:
    for index, ids in enumerate(token_id_lists):
        if len(ids) > max_input_tokens:
            raise ContextLengthExceededError(
                f"input {index} has {len(ids)} tokens, more than this model's maximum of "
                f"{max_input_tokens}; shorten it, or set 'truncate_prompt_tokens' to cut it",
                param="input")
