"""benchmarks/batches.py, smoke-sized: the offline engine, then `llmplatform serve` (real processes)
with a tiny model, the interactive load alone and beside a batch uploaded and run through the
official client, and the batch alone. Checks the report's structure and the counts, never timings."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_batches_benchmark_smoke(tiny_model_dir, capsys):
    bench = load_benchmark("batches")
    code = bench.main(["--model-path", str(tiny_model_dir), "--dtype", "float32",
                       "--lines", "48", "--offline-lines", "8", "--max-tokens", "4",
                       "--streams", "2", "--interactive-requests", "2", "--interactive-output", "4",
                       "--window-s", "20", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB"])
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.splitlines()[-1].removeprefix("RESULT_JSON "))
    for run in (result["alone"], result["beside"]):
        assert run["num_completed"] == run["num_requests"] == 4
        assert run["output_tokens"] == 16  # EOS ignored: exactly max_tokens each
    assert result["lines_failed"] == 0 and result["offline_tok_s"] > 0
    assert set(result["ratios"]) == {"ttft_p50", "itl_p50", "batch_vs_offline"}
    assert "interactive ITL p50 (ms)" in printed
