"""The cross-encoder backend (llm/cross_encoder.py) against sentence-transformers' own
``CrossEncoder.predict`` on the same folder: a tiny random BertForSequenceClassification."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest

from llmplatform.errors import ContextLengthExceededError
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.llm.cross_encoder import CrossEncoderLLM, read_activation
from llmplatform.llm.embedding import ModelTask
from llmplatform.llm.encoder_config import EmbeddingConfigError, is_cross_encoder, is_embedding_model
from tests.conftest import TINY_CROSS_ENCODER_POSITIONS

WORDS = "the sea river quick brown fox jumps over lazy dog capital of france paris is a city".split()


def _texts(count: int, seed: int, max_words: int = 20) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def llm(tiny_cross_encoder_dir: Path) -> CrossEncoderLLM:
    backend = build_backend(BackendConfig(model_path=str(tiny_cross_encoder_dir),
                                          model_names=("rerank",), device="cpu"))
    assert isinstance(backend, CrossEncoderLLM)
    yield backend
    backend._executor.shutdown(wait=True)


def _score(llm: CrossEncoderLLM, text_1: list[str], text_2: list[str],
           max_tokens: int | None = None) -> list[float]:
    async def run() -> list[float]:
        await llm.start()
        try:
            pairs = llm.score_token_ids_sync(text_1, text_2, max_tokens)
            # Two requests at once: their pairs share batches, and must not notice.
            half = len(pairs) // 2
            first, second = await asyncio.gather(llm.score(pairs[:half]), llm.score(pairs[half:]))
            return first + second
        finally:
            await llm._batcher.shutdown()  # the torch thread stays for the next test

    return asyncio.run(run())


def test_the_folder_is_a_cross_encoder(tiny_cross_encoder_dir: Path, llm: CrossEncoderLLM) -> None:
    assert is_cross_encoder(tiny_cross_encoder_dir)
    assert not is_embedding_model(tiny_cross_encoder_dir)
    assert llm.facts.tasks == (ModelTask.SCORE,)
    assert llm.facts.context_length == TINY_CROSS_ENCODER_POSITIONS
    assert llm.activation == "sigmoid"


def test_scores_match_sentence_transformers(tiny_cross_encoder_dir: Path,
                                            llm: CrossEncoderLLM) -> None:
    from sentence_transformers import CrossEncoder

    queries = _texts(1, seed=1) * 12 + _texts(12, seed=2)
    documents = _texts(24, seed=3, max_words=40)
    reference = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu").predict(
        list(zip(queries, documents)), batch_size=5)
    ours = np.array(_score(llm, queries, documents))
    assert ours.shape == reference.shape == (24,)
    assert np.abs(ours - reference).max() < 1e-5
    assert float(np.std(ours)) > 1e-3  # the random model tells the pairs apart


def test_long_pairs_are_refused_or_cut_as_sentence_transformers_cuts(
        tiny_cross_encoder_dir: Path, llm: CrossEncoderLLM) -> None:
    from sentence_transformers import CrossEncoder

    long_document = " ".join(_texts(1, seed=4, max_words=1)[0] for _ in range(200))
    long_query = " ".join(WORDS * 6)
    text_1, text_2 = ["a query", long_query, "q"], [long_document, long_document, "short"]
    with pytest.raises(ContextLengthExceededError) as refused:
        _score(llm, text_1, text_2)
    assert refused.value.param == "text_2"
    cut = _score(llm, text_1, text_2, max_tokens=TINY_CROSS_ENCODER_POSITIONS)
    # CrossEncoder cuts every pair to the tokenizer's limit, longest text first.
    reference = CrossEncoder(str(tiny_cross_encoder_dir), device="cpu").predict(list(zip(text_1, text_2)))
    assert np.abs(np.array(cut) - reference).max() < 1e-5


def test_activation_comes_from_the_config(tmp_path: Path) -> None:
    def folder(**config) -> Path:
        path = tmp_path / str(len(list(tmp_path.iterdir())))
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return path

    assert read_activation(folder()) == "sigmoid"
    assert read_activation(folder(sentence_transformers={
        "activation_fn": "torch.nn.modules.linear.Identity"})) == "identity"
    assert read_activation(folder(sbert_ce_default_activation_function=
                                  "torch.nn.modules.activation.Sigmoid")) == "sigmoid"
    with pytest.raises(EmbeddingConfigError, match="Tanh"):
        read_activation(folder(sentence_transformers={"activation_fn": "torch.nn.Tanh"}))
    with pytest.raises(EmbeddingConfigError, match="3 labels"):
        read_activation(folder(id2label={"0": "a", "1": "b", "2": "c"}))


def test_tasks_that_do_not_fit_the_folder_are_refused(tiny_cross_encoder_dir: Path,
                                                      embedding_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cross-encoder.*--task embed"):
        build_backend(BackendConfig(model_path=str(tiny_cross_encoder_dir), task="embed", device="cpu"))
    with pytest.raises(ValueError, match="--task score serves cross-encoders"):
        build_backend(BackendConfig(model_path=str(embedding_model_dir), task="score", device="cpu"))
