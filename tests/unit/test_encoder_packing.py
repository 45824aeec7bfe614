"""The encoder's packed forward pass (llm/encoder.py): inputs laid end to end in rows, each
seeing only itself, give the padded pass's hidden states and vectors; the batch plan and the
row packing it relies on."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from llmplatform.llm.embed_batcher import plan_batches
from llmplatform.llm.encoder import PACK_ROW_TOKENS, EncoderEmbeddingLLM, pack_rows


def test_packed_batches_are_bounded_by_their_tokens() -> None:
    lengths = [10, 3, 50, 4, 9, 200]
    assert plan_batches(lengths, max_batch_tokens=40, packed=True) == [[1, 3, 4, 0], [2], [5]]
    assert plan_batches(lengths, max_batch_tokens=80, packed=True) == [[1, 3, 4, 0, 2], [5]]
    # The same bound padded: 5 inputs x 50 tokens is over 80.
    assert plan_batches(lengths, max_batch_tokens=80) == [[1, 3, 4, 0], [2], [5]]


def test_rows_are_packed_first_fit_longest_first() -> None:
    lengths = [100, 200, 60, 300, 50, 10]
    rows = pack_rows(lengths, 256)
    assert rows == [[3], [1, 4], [0, 2, 5]]
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 256 or len(row) == 1 for row in rows)
    assert pack_rows([], 256) == []


@pytest.fixture(scope="module")
def encoder(embedding_model_dir: Path) -> EncoderEmbeddingLLM:
    llm = EncoderEmbeddingLLM(str(embedding_model_dir), ("e",), device="cpu")
    yield llm
    llm._executor.shutdown(wait=True)


def _inputs(encoder: EncoderEmbeddingLLM) -> list[list[int]]:
    rng = random.Random(0)
    words = "the sea river quick brown fox jumps over lazy dog vectors search of documents".split()
    texts = ["", "one"] + [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
                           for _ in range(40)]
    texts.append(" ".join(rng.choice(words) for _ in range(PACK_ROW_TOKENS + 40)))  # a row alone
    return encoder.embedding_token_ids_sync(texts, None)


def test_packed_hidden_states_and_vectors_equal_the_padded_ones(encoder: EncoderEmbeddingLLM) -> None:
    assert encoder.packed  # all-MiniLM-L6-v2 is a BertModel
    ids = _inputs(encoder)
    assert max(len(x) for x in ids) > PACK_ROW_TOKENS and min(len(x) for x in ids) <= 3

    def run() -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            return (*encoder._run_packed(ids), *encoder._run_padded(ids))

    packed, packed_mask, padded, padded_mask = encoder._executor.submit(run).result()
    assert torch.equal(packed_mask, padded_mask)
    real = padded_mask.bool()
    assert torch.allclose(packed[real], padded[real], atol=1e-4, rtol=0)

    def vectors(packed_run: bool) -> np.ndarray:
        encoder.packed = packed_run  # _forward packs this mixed batch (it would pad > 1.25x)
        try:
            return encoder._executor.submit(encoder._forward, ids).result()
        finally:
            encoder.packed = True

    a, b = vectors(True), vectors(False)
    assert float((a * b).sum(axis=1).min()) > 1 - 1e-6


def test_a_batch_that_pads_little_is_padded(encoder: EncoderEmbeddingLLM, monkeypatch) -> None:
    calls: list[str] = []
    for name in ("_run_packed", "_run_padded"):
        original = getattr(encoder, name)
        monkeypatch.setattr(encoder, name, lambda ids, _o=original, _n=name: calls.append(_n) or _o(ids))
    even = [[101] + [2000 + i] * 20 + [102] for i in range(8)]  # equal lengths: no padding
    mixed = [[101, 2000, 102], [101] + [2001] * 60 + [102]]
    encoder._executor.submit(encoder._forward, even).result()
    encoder._executor.submit(encoder._forward, mixed).result()
    assert calls == ["_run_padded", "_run_packed"]
