"""benchmarks/serve.py, smoke-sized: its client against a real tiny-model stack (gateway,
controller, paged worker, each a real uvicorn server), and ``--systems`` starting each system
itself. Checks the report's structure and that its counts add up; never its timings."""

from __future__ import annotations

import functools
import json
import shlex
import sys
from pathlib import Path

import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from tests.benchmark_scripts import load_benchmark
from tests.integration.cluster import running_cluster

WORKLOAD = ["--prompt-len", "8:40", "--output-len", "3:9", "--warmup-requests", "1", "--seed", "3"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("serve")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), model_names=("tiny",), backend="paged",
                                  device="cpu", dtype="float32", kv_cache_memory="64MiB"))
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        yield cluster


def run_bench(bench, tmp_path: Path, name: str, argv: list[str]) -> tuple[int, dict, str]:
    code = bench.main([*argv, *WORKLOAD, "--out-dir", str(tmp_path), "--name", name])
    result = json.loads((tmp_path / f"{name}.json").read_text())
    report = (tmp_path / f"{name}.md").read_text()
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return code, result, report


def check_counts(run: dict, num_requests: int, expected: list[tuple[int, int]]) -> None:
    """Every request completed with exactly its output length (EOS ignored), the prompt token
    counts the server reported equal the benchmark's own, and the summary's sums add up."""
    summary, requests = run["summary"], run["requests"]
    assert summary["num_requests"] == summary["num_completed"] == len(requests) == num_requests
    assert summary["num_failed"] == summary["num_short"] == 0 and summary["errors"] == []
    assert summary["tokens_counted_from"] == "usage"
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in requests] == expected
    assert all(r["expected_output_tokens"] == r["output_tokens"] for r in requests)
    assert summary["output_tokens"] == summary["expected_output_tokens"] == sum(n for _, n in expected)
    assert summary["prompt_tokens"] == sum(p for p, _ in expected)
    assert summary["request_throughput"] == pytest.approx(num_requests / summary["wall_s"], rel=1e-2)
    for r in requests:
        assert 0 < r["ttft"] <= r["e2e"]
        assert r["start"] + r["e2e"] <= summary["wall_s"] + 1e-3
    for key in ("ttft", "itl", "e2e"):
        assert summary[f"{key}_ms_p50"] <= summary[f"{key}_ms_p99"]


@functools.lru_cache(maxsize=2)
def tokenizer_and_ids(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    from serve_client import allowed_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer, allowed_token_ids(tokenizer)


def expected_workload(bench, tokenizer_dir: Path, level: float, count: int) -> list[tuple[int, int]]:
    """The requests the benchmark draws at a level, drawn again here: (prompt, output) tokens."""
    from serve_client import make_requests

    tokenizer, allowed = tokenizer_and_ids(tokenizer_dir)
    requests = make_requests(tokenizer, allowed, count, f"serve/3/{level:g}", (8, 40), (3, 9))
    return [(r.prompt_len, r.output_len) for r in requests]


def test_gateway_and_direct_worker_runs_add_up(bench, cluster, tiny_model_dir, tmp_path):
    common = ["--model", "tiny", "--tokenizer", str(tiny_model_dir), "--concurrency", "1,3", "--num-prompts", "5"]
    code, via_gateway, report = run_bench(bench, tmp_path, "gateway",
                                          ["--base-url", f"{cluster.gateway_url}/v1", *common])
    assert code == 0 and via_gateway["failures"] == {}
    assert set(via_gateway["runs"]["url"]) == {"1", "3"}
    for level in ("1", "3"):
        check_counts(via_gateway["runs"]["url"][level], 5, expected_workload(bench, tiny_model_dir, float(level), 5))
    rows = [line for line in report.splitlines() if line.startswith("| url |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "3"]
    assert all(row.split("|")[3].strip() == "5/5" for row in rows)

    # The same requests straight to the worker over FastChat's NUL-delimited stream.
    code, direct, _ = run_bench(bench, tmp_path, "direct",
                                ["--base-url", cluster.worker_urls["tiny"], "--api", "worker", *common])
    assert code == 0
    for level in ("1", "3"):
        assert ([(r["prompt_tokens"], r["output_tokens"]) for r in direct["runs"]["url"][level]["requests"]]
                == [(r["prompt_tokens"], r["output_tokens"]) for r in via_gateway["runs"]["url"][level]["requests"]])


def test_poisson_rate_run(bench, cluster, tiny_model_dir, tmp_path):
    code, result, report = run_bench(bench, tmp_path, "rate", [
        "--base-url", f"{cluster.gateway_url}/v1", "--model", "tiny", "--tokenizer", str(tiny_model_dir),
        "--request-rate", "50", "--num-prompts", "6"])
    assert code == 0
    run = result["runs"]["url"]["50"]
    check_counts(run, 6, expected_workload(bench, tiny_model_dir, 50.0, 6))
    starts = [r["start"] for r in run["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0  # sent in order, spread over time
    assert "| url | 50/s | 6/6 |" in report


def test_bad_server_is_reported_as_failed_requests(bench, cluster, tiny_model_dir, tmp_path):
    """A model the gateway does not serve: every request fails with the server's error message,
    nothing is counted as output, and the run still writes its report."""
    code = bench.main(["--base-url", f"{cluster.gateway_url}/v1", "--model", "no-such-model", "--tokenizer",
                       str(tiny_model_dir), "--concurrency", "2", "--num-prompts", "3", "--warmup-requests", "0",
                       "--prompt-len", "8:12", "--output-len", "2:3", "--out-dir", str(tmp_path), "--name", "bad"])
    assert code == 0  # nothing failed to start; the requests failed and the report says so
    summary = json.loads((tmp_path / "bad.json").read_text())["runs"]["url"]["2"]["summary"]
    assert summary["num_failed"] == 3 and summary["num_completed"] == 0 and summary["output_tokens"] == 0
    assert summary["errors"] and "404" in summary["errors"][0]
    assert "3 failed" in (tmp_path / "bad.md").read_text()


@pytest.mark.slow
def test_systems_started_by_the_benchmark(bench, tiny_model_dir, tmp_path):
    """The --all path on the tiny model: llmplatform serve (paged, then hf) and transformers
    serve started as subprocesses, one at a time, and the ratios computed from their runs."""
    code, result, report = run_bench(bench, tmp_path, "systems", [
        "--systems", "paged,direct,hf,tserve", "--model-path", str(tiny_model_dir), "--concurrency", "1,2",
        "--num-prompts", "2", "--compare-at", "2", "--gateway-pairs", "3", "--log-dir", str(tmp_path / "logs")])
    assert result["failures"] == {}, result["failures"]
    assert code == 0
    assert set(result["runs"]) == {"paged", "direct", "hf", "tserve"}
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| ") and "| system |" not in line]
    assert [(row[1].strip(), row[2].strip(), row[3].strip()) for row in rows] == [
        (system, level, "2/2") for system in ("paged", "direct", "hf", "tserve") for level in ("1", "2")]
    for system, levels in result["runs"].items():
        for level, run in levels.items():
            check_counts(run, 2, expected_workload(bench, tiny_model_dir, float(level), 2))
    ratios = result["ratios"]
    assert set(ratios) >= {"paged_over_tserve", "paged_over_hf", "gateway_added_latency"}
    gateway = ratios["gateway_added_latency"]
    assert gateway["ttft_p50_diff_ms"] is not None
    # The interleaved phase: 3 requests each sent both ways, the worker's own TTFT subtracted.
    phase = gateway["interleaved"]
    assert phase["pairs"] == 3 and phase["failed"] == 0
    assert phase["direct_overhead_ms_p50"] > 0 and phase["gateway_overhead_ms_p50"] > 0
    assert gateway["met"] == (phase["added_ms_p50"] <= 2.0)
    assert "paged over transformers serve" in report and "Gateway added latency per request" in report
    # ...and through the bare reference proxy, which answered every one of them.
    assert phase["reference_added_ms_p50"] is not None and phase["paired_minus_reference_ms_p50"] is not None
    assert "bare pass-through proxy" in report
    assert "Traceback" not in (tmp_path / "logs" / "bare-proxy.log").read_text()


def test_ratios_flag_rows_that_lost_different_cpu_to_the_hypervisor(bench):
    import serve_report

    def run(tok_s: float, steal: float) -> dict:
        return {"summary": {"output_throughput": tok_s}, "cores": {"steal_cores": steal}, "requests": []}

    runs = {"paged": {32.0: run(90.0, 0.03)}, "hf": {32.0: run(10.0, 0.41)}, "tserve": {32.0: run(30.0, 0.05)}}
    ratios = serve_report.compute_ratios(runs, "concurrency", 32.0, 1.0)
    assert ratios["paged_over_hf"]["value"] == 9.0 and ratios["paged_over_hf"]["met"]
    lines = serve_report._ratio_lines(ratios)
    hf_line = next(line for line in lines if "our hf backend" in line)
    assert "caveat" in hf_line and "0.41" in hf_line and "flattered" in hf_line
    assert "caveat" not in next(line for line in lines if "transformers serve" in line)  # 0.02 apart
    runs["paged"][32.0]["cores"]["steal_cores"] = 0.6
    assert "understated" in next(line for line in serve_report._ratio_lines(
        serve_report.compute_ratios(runs, "concurrency", 32.0, 1.0)) if "our hf backend" in line)


STANDIN = Path(__file__).with_name("llamacpp_standin.py")


SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0}


def test_llamacpp_systems_against_a_stand_in_server(bench, tiny_model_dir, tmp_path):
    """The llamacpp systems' start, client and report code against a stand-in llama-server
    (`llamacpp_standin.py`: llama.cpp's command line and response shape, no model): the test
    suite never builds llama.cpp. The stand-in stops after one token unless asked to ignore EOS,
    as the real server does, and records what the benchmark sent (here with --sampling)."""
    record = tmp_path / "standin.jsonl"
    # Run the stand-in with this interpreter (its shebang's python3 may be one without our
    # dependencies, e.g. the system one when the suite runs from a virtual environment).
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} \"$@\"\n")
    server.chmod(0o755)
    code, result, report = run_bench(bench, tmp_path, "llamacpp", [
        "--systems", "llamacpp,llamacpp-q8_0", "--model-path", str(tiny_model_dir), "--concurrency", "1,3",
        "--num-prompts", "4", "--llama-server", str(server),
        "--llamacpp-gguf", f"bf16={tiny_model_dir},q8_0={tiny_model_dir}", "--llamacpp-slots", "4",
        f"--llamacpp-args=--record {record}", "--bandwidth-buffer-mib", "8", "--log-dir", str(tmp_path / "logs"),
        "--sampling", json.dumps(SAMPLING)])
    assert result["failures"] == {}, result["failures"]
    assert code == 0
    for system in ("llamacpp", "llamacpp-q8_0"):
        for level in ("1", "3"):
            run = result["runs"][system][level]
            check_counts(run, 4, expected_workload(bench, tiny_model_dir, float(level), 4))
            # The stand-in drops the request after a stream on a kept-alive connection, as
            # llama-server does: sent again on a new connection, counted, and noted in the report.
            assert run["summary"]["num_resent"] >= 1
            assert sum(r["resent"] for r in run["requests"]) >= run["summary"]["num_resent"]
            assert f"{system} at {level}: {run['summary']['num_resent']} requests sent again" in report
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    argvs = [line["argv"] for line in lines if "argv" in line]
    assert len(argvs) == 2  # one server per system, one after the other
    for argv in argvs:
        flags = dict(zip(argv, argv[1:]))
        assert flags["-np"] == "4" and flags["--host"] == "127.0.0.1"
        assert int(flags["-c"]) == 4 * 256  # 40 + 9 tokens + margin, rounded up to 256 per slot
        assert flags["-t"] == flags["-tb"]
    bodies = [line["body"] for line in lines if line.get("path") == "/v1/completions"]
    # --sampling's fields in every request (warm-up included), over the greedy default.
    assert bodies and all(b["stream"] and b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True}
                          and {k: b[k] for k in SAMPLING} == SAMPLING for b in bodies)
    assert result["meta"]["sampling"] == SAMPLING and f"sampling {json.dumps(SAMPLING)}" in report
    # The ratios to llama.cpp bf16 (here: the Q8_0 row over the bf16 one) and the bandwidth floor.
    rows = result["ratios"]["llamacpp"]["llamacpp-q8_0"]
    assert set(rows) == {"1", "3"} and all(row["tok_s"] > 0 and row["targets"] == {} for row in rows.values())
    bandwidth = result["meta"]["bandwidth"]
    assert bandwidth["read_gb_s"] > 0
    assert set(bandwidth["floors"]) == {"llmplatform (bfloat16)", "llama.cpp bf16 GGUF", "llama.cpp q8_0 GGUF"}
    assert "Against llama.cpp bf16" in report and "Memory-bandwidth floor of one stream" in report


def test_llamacpp_ratios_check_the_targets(bench):
    import serve_report

    def run(tok_s: float, ttft: float, itl: float) -> dict:
        return {"summary": {"output_throughput": tok_s, "ttft_ms_p50": ttft, "itl_ms_p50": itl}}

    runs = {"llamacpp": {1.0: run(60, 50, 14), 8.0: run(190, 300, 30), 32.0: run(200, 4000, 60)},
            "paged": {1.0: run(40, 40, 15), 8.0: run(180, 200, 35), 32.0: run(320, 3000, 50)}}
    ratios = serve_report.compute_llamacpp_ratios(runs, "concurrency", [1.0, 8.0, 32.0])
    paged = ratios["paged"]
    assert paged["1"]["itl_p50"] == pytest.approx(15 / 14, abs=1e-3)
    assert paged["1"]["targets"]["itl_p50"] == {"bound": "<= 1.1x", "met": True}  # issue 41's bound
    runs["paged"][1.0] = run(40, 40, 16)  # 1.14x
    assert not serve_report.compute_llamacpp_ratios(runs, "concurrency", [1.0])["paged"]["1"]["targets"][
        "itl_p50"]["met"]
    assert paged["8"]["targets"]["tok_s"]["met"] is False
    assert paged["32"]["targets"] == {"tok_s": {"bound": ">= 1.5x", "met": True},
                                      "ttft_p50": {"bound": "< 1x", "met": True}}
    assert serve_report.compute_llamacpp_ratios({"paged": runs["paged"]}, "concurrency", [1.0]) == {}


def test_all_skips_llamacpp_where_it_cannot_be_built(bench, monkeypatch, tmp_path):
    """--all without cmake or a compiler: the llama.cpp systems are skipped with the reason, not
    failed (the other systems' run still counts)."""
    import build_llamacpp
    import serve_llamacpp

    monkeypatch.setattr(build_llamacpp, "missing_tools", lambda: ["cmake"])
    monkeypatch.setattr(build_llamacpp, "server_path", lambda version=None: tmp_path / "absent")

    class Args:
        all, llama_server, llamacpp_gguf = True, None, None

    class Bench:
        args, skipped, failures = Args(), {}, {}

    serve_llamacpp.run(Bench, ["llamacpp", "llamacpp-q8_0"], "unused", "m", tmp_path, None, lambda _: None)
    assert Bench.failures == {}
    assert set(Bench.skipped) == {"llamacpp", "llamacpp-q8_0"}
    assert "cmake not found" in Bench.skipped["llamacpp"] and "apt-get install" in Bench.skipped["llamacpp"]
