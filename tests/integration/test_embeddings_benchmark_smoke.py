"""benchmarks/embeddings.py, smoke-sized: the real packaged model behind `llmplatform serve`
(real processes). Checks the report's rows and that every vector matched sentence-transformers';
never timings."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_embeddings_benchmark_smoke(embedding_model_dir, tmp_path, capsys):
    bench = load_benchmark("embeddings")
    out = tmp_path / "result.json"
    code = bench.main(["--model-path", str(embedding_model_dir), "--num-sentences", "12",
                       "--concurrency", "1,4", "--batch", "4", "--warmup", "2", "--repeats", "2",
                       "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["run"] for r in result["runs"]] == [
        "st encode batch4", "gateway c=1", "gateway c=4", "gateway batch4"]
    assert all(r["min_cosine"] >= 0.9999 for r in result["runs"][1:])
    assert result["runs"][0]["ratio_to_st"] == 1.0 and result["repeats"] == 2
    assert all(len(r["all_sentences_per_s"]) == 2 for r in result["runs"])
    assert all(r["sentences_per_s"] == max(r["all_sentences_per_s"]) for r in result["runs"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT_JSON ")
