"""The embedding pieces without servers: batch planning, the folder's sentence-transformers
configuration, Matryoshka checks and truncation, the packaged zip's safety checks."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from llmplatform.errors import InvalidRequestError
from llmplatform.llm.embed_batcher import plan_batches
from llmplatform.llm.embedding import EmbeddingFacts, check_dimensions, truncate_vector
from llmplatform.llm.encoder_config import EmbeddingConfigError, is_embedding_model, read_pipeline
from llmplatform.llm.packaged import PackagedModelError, unpack_model_zip


def test_batches_are_sorted_by_length_and_bounded_by_padded_tokens() -> None:
    lengths = [10, 3, 50, 4, 9, 200]
    assert plan_batches(lengths, max_batch_tokens=40) == [[1, 3, 4, 0], [2], [5]]
    assert plan_batches(lengths, max_batch_tokens=10_000) == [[1, 3, 4, 0, 2, 5]]
    assert plan_batches([], max_batch_tokens=8) == []


def _folder(tmp_path: Path, pooling: dict, modules: list[str], config: dict | None = None) -> Path:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "path": "1_Pooling" if m == "Pooling" else "",
          "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]))
    (tmp_path / "config.json").write_text(json.dumps(config or {"architectures": ["BertModel"]}))
    return tmp_path


def test_pipeline_from_sentence_transformers_files(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True},
                     ["Transformer", "Pooling"],
                     {"architectures": ["BertModel"], "matryoshka_dimensions": [64, 256]})
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 128, "do_lower_case": true}')
    pipeline = read_pipeline(folder)
    assert pipeline.pooling_modes == ("cls_token", "max_tokens") and not pipeline.normalize
    assert (pipeline.max_seq_length, pipeline.do_lower_case) == (128, True)
    assert pipeline.matryoshka_dimensions == (256, 64)
    assert is_embedding_model(folder)


def test_unsupported_pipelines_are_refused(tmp_path: Path) -> None:
    weighted = _folder(tmp_path, {"pooling_mode_weightedmean_tokens": True}, ["Transformer", "Pooling"])
    with pytest.raises(EmbeddingConfigError, match="weighted mean"):
        read_pipeline(weighted)


def test_a_decoder_folder_is_not_an_embedding_model(tiny_model_dir: Path) -> None:
    assert not is_embedding_model(tiny_model_dir)


def test_matryoshka_dimensions() -> None:
    plain = EmbeddingFacts(dimensions=8, max_input_tokens=16, normalized=True)
    with pytest.raises(InvalidRequestError) as refused:
        check_dimensions(plain, "m", 4)
    assert refused.value.param == "dimensions"
    listed = EmbeddingFacts(8, 16, True, matryoshka_dimensions=(8, 4))
    check_dimensions(listed, "m", 4)
    with pytest.raises(InvalidRequestError):
        check_dimensions(listed, "m", 3)
    check_dimensions(EmbeddingFacts(8, 16, True, matryoshka_dimensions=()), "m", 3)
    cut = truncate_vector(np.arange(1, 9, dtype=np.float32), 4, normalized=True)
    np.testing.assert_allclose(cut, np.array([1, 2, 3, 4]) / np.sqrt(30), rtol=1e-6)


def test_a_zip_member_outside_the_folder_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("../escape.json", "{}")
    with pytest.raises(PackagedModelError, match="leaves the folder"):
        unpack_model_zip(bad, tmp_path / "out")
