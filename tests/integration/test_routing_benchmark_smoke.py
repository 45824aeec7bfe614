"""benchmarks/routing.py, smoke-sized: two policies on clusters of two tiny-model paged workers
(real processes). Checks the report's structure and what the counters must show whatever the
timings: every request answered with its exact output length, prompts looked up in the workers'
prefix caches, the cache-bound pass on workers whose pool is the fraction asked of the shared
prompts' blocks. Never timings."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_routing_benchmark_smoke(tiny_model_dir, tmp_path, capsys):
    bench = load_benchmark("routing")
    out = tmp_path / "result.json"
    code = bench.main(["--model-path", str(tiny_model_dir), "--dtype", "float32",
                       "--policies", "least_load,cache_aware", "--concurrency", "2",
                       "--num-prefixes", "2", "--questions-per-prefix", "3", "--prefix-tokens", "120",
                       "--skewed-requests", "8", "--unshared-requests", "3", "--unshared-tokens", "20",
                       "--output-len", "2", "--worker-flag=--max-num-batched-tokens=512", "--refresh-interval", "0.25",
                       "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"least_load", "cache_aware"}
    assert 0 < result["ideal_hit_rate"] < 1
    for policy, runs in result["results"].items():
        assert [runs[w]["num_requests"] for w in ("shared", "skewed", "unshared", "shared_bound")] == [6, 8, 3, 6], \
            policy
        for run in runs.values():
            assert run["output_tokens"] == 2 * run["num_requests"]  # EOS ignored: exactly max_tokens
            assert sum(run["served_per_worker"]) == run["num_requests"]
            assert run["prompt_tokens_looked_up"] > 0
            assert (sum(run["computed_prompt_tokens_per_worker"])
                    == run["prompt_tokens_looked_up"] - run["hit_tokens"])
        assert runs["shared"]["hit_tokens"] > 0  # 3 questions per prefix: some reuse, any policy
    assert set(result["ratios"]["cache_aware"]) == {
        "hit_rate_of_ideal", "skewed_max_worker_share", "skewed_max_worker_computed_share",
        "ttft_p50_least_load_over_this", "ttft_mean_least_load_over_this", "throughput_over_least_load",
        "bound_hit_rate_of_ideal", "bound_ttft_p50_least_load_over_this", "bound_ttft_mean_least_load_over_this",
        "bound_throughput_over_least_load", "unshared_throughput_over_least_load"}
    # The bound pool: the fraction asked of the two shared prompts' full blocks (120-token prompts:
    # 7 or 8 blocks each), but never less than one --max-model-len sequence.
    bound = result["bound_regime"]
    assert 12 <= bound["working_set_blocks"] <= 18
    assert bound["pool_blocks"] == max(round(0.6 * bound["working_set_blocks"]), bound["max_model_len"] // 16)
    assert bound["max_model_len"] % 16 == 0 and bound["max_model_len"] >= 120
    printed = capsys.readouterr().out
    assert "| cache_aware |" in printed and "shared_bound: hit rate" in printed and printed.splitlines()[-1].startswith("RESULT_JSON ")
