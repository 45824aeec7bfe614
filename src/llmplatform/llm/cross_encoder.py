"""The cross-encoder backend: rerankers of the BERT family (``BertForSequenceClassification``...).

A cross-encoder reads a query and a document together and gives their relevance, one number
(``llm.scoring``). It serves ``ModelTask.SCORE`` only: ``/v1/rerank`` and ``/v1/score``; a
generation or embeddings request is refused with a 400 that says so.

Scores are made as sentence-transformers' ``CrossEncoder.predict`` makes them: the pair
tokenized together (the second text's token type 1), the classifier's single logit, then the
activation the folder names in ``config.json`` (``sentence_transformers.activation_fn``, or the
older ``sbert_ce_default_activation_function``): a sigmoid when it names none, as
sentence-transformers does for one label. A classifier with several labels is no reranker and is
refused at load.

Pairs are batched across requests by the embeddings' batcher (``embed_batcher``), padded to
the longest of a batch (packing, as ``encoder`` does for BERT embeddings, would need the token
types packed too; pairs are long and alike, and pad little). Every forward pass, and the load,
run on one torch thread; ``auto`` dtype is float32, so scores match sentence-transformers' to
float precision.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import numpy as np
import torch

from llmplatform.errors import InvalidRequestError
from llmplatform.llm.base import AdmittedRequest, GenerateRequest, LLMBackend, ModelFacts
from llmplatform.llm.embed_batcher import BatchedBackendMixin, BatchingConfig, EmbedBatcher
from llmplatform.llm.embedding import EmbeddingResult, ModelTask
from llmplatform.llm.encoder import max_input_tokens
from llmplatform.llm.encoder_config import EmbeddingConfigError
from llmplatform.llm.scoring import PairTokens, check_pair_lengths
from llmplatform.sampling.outputs import GenerateChunk
from llmplatform.utils.torch_utils import resolve_device, torch_thread

logger = logging.getLogger("llmplatform.encoder")

ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}
"""The activations a folder may name (by the class's last dotted part), and what runs."""


def read_activation(model_path: str | Path) -> str:
    """``sigmoid`` or ``identity``: what the folder's config asks to apply to the logit."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if num_labels != 1:
        raise EmbeddingConfigError(
            f"{model_path} is a classifier with {num_labels} labels, not a reranker (one label: "
            "the relevance of a pair)")
    st_config = config.get("sentence_transformers")
    named = (st_config.get("activation_fn") if isinstance(st_config, dict) else None) \
        or config.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid"
    activation = ACTIVATIONS.get(str(named).rsplit(".", 1)[-1])
    if activation is None:
        raise EmbeddingConfigError(f"{model_path}: activation {named!r} is not supported "
                                   f"(supported: {', '.join(ACTIVATIONS)})")
    return activation


class CrossEncoderLLM(BatchedBackendMixin, LLMBackend):
    """Serves ``/v1/rerank`` and ``/v1/score`` for one cross-encoder model folder."""

    backend_name = "encoder"
    default_concurrency = 1024  # requests are batched together: let them all through

    def __init__(self, model_path: str, model_names: tuple[str, ...], *, device: str = "auto",
                 dtype: str = "auto", max_model_len: int | None = None,
                 batching: BatchingConfig = BatchingConfig(),
                 trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.activation = read_activation(model_path)
        self.device = resolve_device(device)
        self.dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._executor = torch_thread("cross-encoder")
        self.model = self._executor.submit(self._load, model_path, trust_remote_code).result()
        self._accepts_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        limit = max_input_tokens(None, self.tokenizer, config)
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        self._facts = ModelFacts(names=tuple(model_names), context_length=limit,
                                 vocab_size=config.vocab_size, tasks=(ModelTask.SCORE,))
        self._batcher = EmbedBatcher(self._forward, self._executor, batching)
        logger.info("loaded cross-encoder %s on %s as %s (%s), pairs up to %d tokens",
                    model_path, self.device, self.dtype, self.activation, limit)

    def _load(self, model_path: str, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForSequenceClassification

        # Weights from safetensors only: a pickled .bin checkpoint can run code on load.
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=self.dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
        return model.to(self.device).eval()

    # ---- the interface -------------------------------------------------------------------------

    async def score(self, pairs: Sequence[PairTokens], *, request_id: str | None = None) -> list[float]:
        check_pair_lengths(pairs, self._facts.context_length, "text_2")
        rows = await self._batcher.embed(pairs)  # type: ignore[arg-type]  (sized, like token lists)
        return [float(row[0]) for row in rows]

    def _not_served(self, what: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"model {self.model_names[0]!r} is a cross-encoder (reranker): it serves /v1/rerank "
            f"and /v1/score, not {what}", param="model")

    async def embed(self, token_id_lists: Sequence[Sequence[int]], *,
                    request_id: str | None = None) -> list[EmbeddingResult]:
        raise self._not_served("/v1/embeddings")

    def check_request(self, request: GenerateRequest) -> AdmittedRequest:
        raise self._not_served("chat or completions")

    def apply_chat_template_sync(self, messages: Sequence[dict[str, Any]],
                                 add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise self._not_served("chat or completions")

    async def generate(self, request: AdmittedRequest) -> AsyncIterator[GenerateChunk]:
        raise self._not_served("chat or completions")
        yield  # an async generator, as the interface's callers expect  # pragma: no cover

    # ---- the forward pass (torch thread) -------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, pairs: list[PairTokens]) -> np.ndarray:
        """``[len(pairs), 1]`` float32 scores, each pair right-padded to the batch's longest."""
        longest = max(max(len(pair) for pair in pairs), 1)
        input_ids = torch.full((len(pairs), longest), self._pad_id, dtype=torch.long)
        token_types = torch.zeros((len(pairs), longest), dtype=torch.long)
        mask = torch.zeros((len(pairs), longest), dtype=torch.long)
        for row, pair in enumerate(pairs):
            n = len(pair)
            input_ids[row, :n] = torch.tensor(pair.input_ids, dtype=torch.long)
            token_types[row, :n] = torch.tensor(pair.token_type_ids, dtype=torch.long)
            mask[row, :n] = 1
        inputs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self._accepts_token_types:
            inputs["token_type_ids"] = token_types.to(self.device)
        logits = self.model(**inputs).logits.float()  # [batch, 1]
        if self.activation == "sigmoid":
            logits = torch.sigmoid(logits)
        return logits.cpu().numpy().astype(np.float32, copy=False)
