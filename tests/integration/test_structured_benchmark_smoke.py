"""benchmarks/structured.py, smoke-sized: against a real tiny-model stack (gateway, controller,
paged worker). Checks the report's structure and that every complete constrained reply
validated; never its timings. The tools workload's prompt (three tool schemas in the system
turn) does not fit the tiny model's 512-token context: only free text and the JSON schema run
here (the tools path has its end-to-end tests on the default model)."""

from __future__ import annotations

import json

from llmplatform.llm.build import BackendConfig, build_backend
from tests.benchmark_scripts import load_benchmark
from tests.integration.cluster import running_cluster


def test_structured_benchmark_smoke(tiny_model_dir, tmp_path, capsys):
    bench = load_benchmark("structured")
    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",),
                                  backend="paged", device="cpu", dtype="float32",
                                  kv_cache_memory="64MiB"))
    out = tmp_path / "result.json"
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        code = bench.main(["--base-url", f"{cluster.gateway_url}/v1", "--model", "tiny",
                           "--tokenizer", str(tiny_model_dir), "--concurrency", "1,3",
                           "--num-prompts", "3", "--output-len", "40", "--out", str(out),
                           "--workloads", "free,json_schema"])
    assert code == 0
    result = json.loads(out.read_text())
    assert [(r["workload"], r["concurrency"]) for r in result["runs"]] == [
        (w, c) for c in (1, 3) for w in ("free", "json_schema", "json_schema_free")]
    for run in result["runs"]:
        assert run["num_requests"] == 3 and run["num_invalid"] == 0, run
        assert run["output_tokens"] > 0
    free = [r for r in result["runs"] if r["workload"] == "free"]
    assert all(r["output_tokens"] == 3 * 40 for r in free)  # EOS ignored: exactly max_tokens
    # Each matched control generated exactly what its constrained run did, request by request.
    runs = {(r["workload"], r["concurrency"]): r for r in result["runs"]}
    for level in (1, 3):
        assert runs[("json_schema_free", level)]["lengths"] == runs[("json_schema", level)]["lengths"]
    assert set(result["ratios"]) == {"json_schema@1", "json_schema@3", "json_schema_vs_matched@1",
                                     "json_schema_vs_matched@3"}
    assert set(result["compile_ms"]) == {"json_schema_cold_ms", "json_schema_cached_ms",
                                         "tools_cold_ms", "tools_cached_ms"}
    printed = capsys.readouterr().out
    assert "| json_schema | 3 | 3 | 0 |" in printed and printed.splitlines()[-1].startswith("RESULT_JSON ")
