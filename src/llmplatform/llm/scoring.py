"""The scoring side of the backend interface: how relevant is one text to another.

A backend that lists :attr:`ModelTask.SCORE <llmplatform.llm.embedding.ModelTask>` in its facts
is a cross-encoder: it reads a pair of texts together (``[CLS] text_1 [SEP] text_2 [SEP]``, the
second segment's token type 1) and gives one number, its relevance. It implements

    def score_token_ids_sync(self, text_1, text_2, max_tokens) -> list[PairTokens]
    async def score(self, pairs: Sequence[PairTokens], *, request_id=None) -> list[float]

(:meth:`~llmplatform.llm.base.LLMBackend.score`): each :class:`PairTokens` is one pair's complete
input (special tokens included, within the model's ``context_length``) and each score that
pair's, in the same order, as sentence-transformers' ``CrossEncoder.predict`` gives it (the
classifier's logit through the model's activation, a sigmoid unless its config says otherwise).
Pairs are batched with other requests' as embeddings are; a score must not depend on it.

An embedding model scores too, as the cosine of the two texts' vectors: the worker does that
(``model_worker.scoring``), not the backend, and says so in its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmplatform.errors import ContextLengthExceededError, InvalidRequestError

@dataclass(frozen=True)
class PairTokens:
    """One pair as the cross-encoder reads it. ``len()`` is its token count (the batcher plans
    by it)."""

    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


def not_a_scoring_model(model: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"model {model!r} is a generation model and serves no scores; use a cross-encoder "
        "(reranker) or an embedding model (GET /v1/models lists what each model serves)",
        param="model")


def check_pair_lengths(pairs: Sequence[PairTokens], max_input_tokens: int, field: str) -> None:
    """Refuse a pair longer than the model reads (400 naming ``field``, the request's second
    text: ``documents`` or ``text_2``)."""
    for index, pair in enumerate(pairs):
        if len(pair) > max_input_tokens:
            raise ContextLengthExceededError(
                f"pair {index} has {len(pair)} tokens, more than this model's maximum of "
                f"{max_input_tokens}; shorten '{field}', or set 'truncate_prompt_tokens' to cut it",
                param=field)
