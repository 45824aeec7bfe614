"""benchmarks/lora.py, smoke-sized, on the tiny model: the report's structure and that every
stream made exactly its tokens in every run (base model, 1 and 2 adapters); never its timings."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_lora_benchmark_smoke(tiny_model_dir, capsys):
    bench = load_benchmark("lora")
    code = bench.main(["--model-path", str(tiny_model_dir), "--streams", "4", "--adapters", "1,2",
                       "--rank", "8", "--prompt-len", "8", "--output-len", "5", "--dtype", "float32",
                       "--repeat", "1"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[-1].removeprefix("RESULT_JSON "))
    assert [(r["name"], r["output_tokens"]) for r in result["runs"]] == [
        ("base model", 20), ("1 adapter(s)", 20), ("2 adapter(s)", 20)]
    assert [line.split()[0] for line in lines[-5:-1]] == ["run", "base", "1", "2"]
