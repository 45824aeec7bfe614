"""The encoder backend: embedding models of the BERT family through transformers' ``AutoModel``.

It serves embeddings only (``ModelTask.EMBED``); a generation request is refused with a 400 that
says so. The vector is made as the folder's sentence-transformers configuration says
(``encoder_config``): the encoder's last hidden states, pooled (mean, CLS, max, last token,
mean/sqrt(len), concatenated when several are on), normalized when the pipeline ends in
Normalize. Inputs longer than ``max_seq_length`` (or the tokenizer's or the model's limit,
whichever is least) are refused or, on request, truncated by the worker before they get here.

Requests are batched together (``embed_batcher``). A BERT-architecture model (BERT, MiniLM, BGE,
e5, ...) runs a batch **packed**: its inputs are laid end to end in rows of ``PACK_ROW_TOKENS``
(first fit, longest first), each with position ids restarting at 0 and an attention mask that
lets a token see only its own input, so no work is spent on padding; a batch that would pad
little (``PACK_ABOVE_PADDING``) is padded instead. The vectors equal the padded run's to float
rounding (2e-7 cosine on all-MiniLM-L6-v2). It pays where lengths are mixed: requests of 32
sentences of 1-60 words ran 102-111 sentences/s padded (sorted, in batches of at most 1024
padded tokens) and 124-144 packed (batches of at most 1024 tokens) on 2 cores, 3 runs each;
512 sentences sorted together ran 149-156 and 156-162. Other architectures are padded: packing
relies on the model taking absolute ``position_ids`` and a 4D mask, which BertModel does and
others may not (RoBERTa's positions start past its padding index, MPNet adds relative buckets).

Every forward pass, and the weights' load, run on one torch thread (``torch_thread``: one OpenMP
team for the process), never on the event loop. ``auto`` dtype is float32: these models are
small, and their vectors then match sentence-transformers' to float precision.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, AsyncIterator, Sequence

import numpy as np
import torch

from llmplatform.errors import InvalidRequestError
from llmplatform.llm.base import AdmittedRequest, GenerateRequest, LLMBackend, ModelFacts
from llmplatform.llm.embed_batcher import BatchedBackendMixin, BatchingConfig, EmbedBatcher
from llmplatform.llm.embedding import EmbeddingFacts, EmbeddingResult, ModelTask, check_lengths
from llmplatform.llm.encoder_config import EncoderPipeline, read_pipeline
from llmplatform.sampling.outputs import GenerateChunk
from llmplatform.utils.torch_utils import resolve_device, torch_thread

logger = logging.getLogger("llmplatform.encoder")

# A tokenizer without a stated limit reports a huge sentinel (1e30) as model_max_length.
_UNBOUNDED = 1_000_000

PACK_ROW_TOKENS = 256
"""Tokens per packed row: attention is computed over a whole row (masked), so a row much longer
than its inputs wastes it; 128 ran slower than 256 on the request above, 512 slower still."""
PACK_ABOVE_PADDING = 1.25
"""A batch is packed when padding it would compute this many times its tokens or more; below,
padding costs less than the packed rows' wider attention (length-sorted batches of many small
requests pad little: 168 sentences/s padded against 134-144 with every batch packed, 2 cores)."""
_PACKED_MODEL_TYPES = frozenset({"bert"})


class EncoderEmbeddingLLM(BatchedBackendMixin, LLMBackend):
    """Serves ``/v1/embeddings`` for one encoder model folder."""

    backend_name = "encoder"
    default_concurrency = 1024  # requests are batched together: let them all through

    def __init__(self, model_path: str, model_names: tuple[str, ...], *, device: str = "auto",
                 dtype: str = "auto", max_model_len: int | None = None,
                 batching: BatchingConfig = BatchingConfig(),
                 trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.pipeline: EncoderPipeline = read_pipeline(model_path)
        self.device = resolve_device(device)
        self.dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._executor = torch_thread("encoder")
        # Loaded on the thread that runs every forward pass (see torch_thread).
        self.model = self._executor.submit(self._load, model_path, trust_remote_code).result()
        self._accepts_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        limit = max_input_tokens(self.pipeline.max_seq_length, self.tokenizer, config)
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        width = config.hidden_size * len(self.pipeline.pooling_modes)
        self._facts = ModelFacts(
            names=tuple(model_names), context_length=limit, vocab_size=config.vocab_size,
            tasks=(ModelTask.EMBED,),
            embedding=EmbeddingFacts(dimensions=width, max_input_tokens=limit,
                                     normalized=self.pipeline.normalize,
                                     matryoshka_dimensions=self.pipeline.matryoshka_dimensions))
        self.packed = getattr(config, "model_type", None) in _PACKED_MODEL_TYPES
        self._batcher = EmbedBatcher(self._forward, self._executor,
                                     dataclasses.replace(batching, packed=self.packed))
        logger.info("loaded %s on %s as %s: %d-dimensional %s embeddings%s, inputs up to %d tokens",
                    model_path, self.device, self.dtype, width, "+".join(self.pipeline.pooling_modes),
                    " (normalized)" if self.pipeline.normalize else "", limit)

    def _load(self, model_path: str, trust_remote_code: bool) -> Any:
        from transformers import AutoModel

        # Weights from safetensors only: a pickled .bin checkpoint can run code on load.
        model = AutoModel.from_pretrained(model_path, dtype=self.dtype, use_safetensors=True,
                                          trust_remote_code=trust_remote_code)
        return model.to(self.device).eval()

    # ---- the interface -------------------------------------------------------------------------

    async def embed(self, token_id_lists: Sequence[Sequence[int]], *,
                    request_id: str | None = None) -> list[EmbeddingResult]:
        check_lengths(token_id_lists, self._facts.context_length)
        vectors = await self._batcher.embed(token_id_lists)
        return [EmbeddingResult(vector, len(ids)) for vector, ids in zip(vectors, token_id_lists)]

    def embedding_token_ids_sync(self, texts: Sequence[str], max_tokens: int | None) -> list[list[int]]:
        if self.pipeline.do_lower_case:  # sentence-transformers lowercases before tokenizing
            texts = [text.lower() for text in texts]
        return super().embedding_token_ids_sync(texts, max_tokens)

    def _not_generation(self) -> InvalidRequestError:
        return InvalidRequestError(
            f"model {self.model_names[0]!r} is an embedding model: it serves /v1/embeddings, not "
            "chat or completions", param="model")

    def check_request(self, request: GenerateRequest) -> AdmittedRequest:
        raise self._not_generation()

    def apply_chat_template_sync(self, messages: Sequence[dict[str, Any]],
                                 add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise self._not_generation()

    async def generate(self, request: AdmittedRequest) -> AsyncIterator[GenerateChunk]:
        raise self._not_generation()
        yield  # an async generator, as the interface's callers expect  # pragma: no cover

    # ---- the forward pass (torch thread) -------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, token_id_lists: list[Sequence[int]]) -> np.ndarray:
        seq_lens = [len(ids) for ids in token_id_lists]
        padded_tokens = len(seq_lens) * max(seq_lens)
        if self.packed and padded_tokens > PACK_ABOVE_PADDING * sum(seq_lens):
            hidden, mask = self._run_packed(token_id_lists)
        else:
            hidden, mask = self._run_padded(token_id_lists)
        pooled = pool(hidden, mask, self.pipeline.pooling_modes)
        if self.pipeline.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy().astype(np.float32, copy=False)

    def _run_padded(self, token_id_lists: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Last hidden states ``[batch, longest, hidden]`` (float32) and the ``[batch, longest]``
        mask of real tokens, each input right-padded to the longest."""
        seq_lens = [len(ids) for ids in token_id_lists]
        longest = max(max(seq_lens), 1)
        input_ids = torch.full((len(token_id_lists), longest), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(token_id_lists), longest), dtype=torch.long)
        for row, ids in enumerate(token_id_lists):
            input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, :len(ids)] = 1
        inputs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self._accepts_token_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        return self.model(**inputs).last_hidden_state.float(), inputs["attention_mask"]

    def _run_packed(self, token_id_lists: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_run_padded`'s result, computed on the inputs packed into rows (module doc)."""
        seq_lens = [len(ids) for ids in token_id_lists]
        rows = pack_rows(seq_lens, PACK_ROW_TOKENS)
        width = max(sum(seq_lens[i] for i in row) for row in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        owner = torch.full((len(rows), width), -1, dtype=torch.long)  # which input; -1: padding
        place: list[tuple[int, int]] = [(0, 0)] * len(token_id_lists)  # input -> (row, start)
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                n = seq_lens[i]
                input_ids[r, start:start + n] = torch.tensor(token_id_lists[i], dtype=torch.long)
                positions[r, start:start + n] = torch.arange(n)
                owner[r, start:start + n] = i
                place[i] = (r, start)
                start += n
        # A token attends to its own input's tokens; a padding slot to itself (a row of all
        # -inf would give NaN, and its output is never read).
        allowed = (owner[:, :, None] == owner[:, None, :]) & (owner[:, :, None] >= 0)
        allowed |= torch.eye(width, dtype=torch.bool)
        bias = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill(
            ~allowed, torch.finfo(self.dtype).min)
        inputs = {"input_ids": input_ids.to(self.device), "position_ids": positions.to(self.device),
                  "attention_mask": bias[:, None].to(self.device)}
        if self._accepts_token_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        packed = self.model(**inputs).last_hidden_state.float()  # [rows, width, hidden]
        # Back to one padded row per input, for the pooling every mode shares.
        longest = max(max(seq_lens), 1)
        hidden = packed.new_zeros((len(token_id_lists), longest, packed.shape[-1]))
        mask = torch.zeros((len(token_id_lists), longest), dtype=torch.long, device=packed.device)
        for i, (r, start) in enumerate(place):
            n = seq_lens[i]
            hidden[i, :n] = packed[r, start:start + n]
            mask[i, :n] = 1
        return hidden, mask


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Indices into ``lengths`` packed into rows of at most ``row_tokens`` (an input longer than
    that gets a row of its own): first fit, longest first."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        for r, free in enumerate(room):
            if free >= length:
                rows[r].append(index)
                room[r] -= length
                break
        else:
            rows.append([index])
            room.append(max(row_tokens - length, 0))
    return rows


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """``[batch, seq, hidden]`` states and ``[batch, seq]`` mask (right padding) ->
    ``[batch, hidden * len(modes)]``, the modes concatenated in the order given."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [batch, seq, 1]
    counts = weights.sum(dim=1).clamp(min=1e-9)  # [batch, 1]
    parts = []
    for mode in modes:
        if mode == "cls_token":
            parts.append(hidden[:, 0])
        elif mode == "max_tokens":
            parts.append(hidden.masked_fill(weights == 0, -1e9).max(dim=1).values)
        elif mode == "mean_tokens":
            parts.append((hidden * weights).sum(dim=1) / counts)
        elif mode == "mean_sqrt_len_tokens":
            parts.append((hidden * weights).sum(dim=1) / counts.sqrt())
        elif mode == "lasttoken":
            last = (mask.sum(dim=1) - 1).clamp(min=0)  # [batch]
            parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return torch.cat(parts, dim=1)


def max_input_tokens(max_seq_length: int | None, tokenizer: Any, config: Any) -> int:
    """The longest input the encoder reads: the least of sentence-transformers' cap, the
    tokenizer's and the model's position limits (512 when none is stated)."""
    limits = [max_seq_length]
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max < _UNBOUNDED:
        limits.append(model_max)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        # RoBERTa-style position ids start after the padding index: two fewer usable positions.
        offset = 2 if getattr(config, "model_type", "") in ("roberta", "xlm-roberta") else 0
        limits.append(positions - offset)
    known = [limit for limit in limits if isinstance(limit, int) and limit > 0]
    return min(known) if known else 512

