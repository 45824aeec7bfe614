"""benchmarks/sampling.py, smoke-sized on the tiny model: both samplers measured for every
setting and batch size, the textbook one swapped back out after. Never timings."""

from __future__ import annotations

import json

from llmplatform.sampling import distribution, sampler
from tests.benchmark_scripts import load_benchmark


def test_sampling_benchmark_smoke(tiny_model_dir, capsys):
    bench = load_benchmark("sampling")
    ours = sampler.Sampler.probabilities, sampler.draw
    code = bench.main(["--model-path", str(tiny_model_dir), "--dtype", "float32", "--batch-sizes", "1,2",
                       "--max-tokens", "4", "--repeats", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.splitlines()[-1].removeprefix("RESULT_JSON "))
    settings = set(bench.SETTINGS)
    assert [(r["batch"], r["sampler"]) for r in result["steps_ms"]] == [
        (1, "ours"), (1, "textbook"), (2, "ours"), (2, "textbook")]
    for run in result["steps_ms"]:
        assert set(run["median_ms"]) == settings and all(ms > 0 for ms in run["median_ms"].values())
    assert {(r["setting"], r["sampler"]) for r in result["sampler_alone_ms"]} == {
        (s, n) for s in settings for n in ("ours", "textbook")}
    assert "| 2 | textbook |" in printed and "textbook / ours" in printed
    assert (sampler.Sampler.probabilities, sampler.draw) == ours  # the textbook sampler swapped back out
    assert sampler.draw is distribution.draw
