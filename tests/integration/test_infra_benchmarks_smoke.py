"""benchmarks/infra_*.py, smoke-sized, as scripts (infra_common.py starts its stand-in servers
as scripts too): each runs both sides and reports every one; never checks the timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llmplatform
from tests.benchmark_scripts import BENCH_DIR

SRC = str(Path(llmplatform.__file__).resolve().parents[1])


def run_script(name: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(BENCH_DIR / f"{name}.py"), *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT_JSON "), done.stdout[-2000:]
    return json.loads(last.removeprefix("RESULT_JSON "))


def test_worker_stream_benchmark_runs_both_clients():
    result = run_script("infra_worker_stream", "--concurrency", "1,4", "--requests", "8", "--rounds", "1",
                        "--chunks", "5")
    assert set(result["results"]) == {"1", "4"}
    for by_client in result["results"].values():
        assert set(by_client) == {"ours", "httpx"}
        assert all(row["wall_ms_per_request"] > 0 for row in by_client.values())


def test_http_protocol_benchmark_runs_every_protocol():
    result = run_script("infra_http_protocol", "--concurrency", "2", "--requests", "8", "--rounds", "1",
                        "--chunks", "3")
    assert set(result["results"]["2"]) == {"ours", "httptools", "h11"}


def test_cbuild_benchmark_builds_and_opens_a_kernel(tmp_path):
    result = run_script("infra_cbuild", "--sources", "silu_mul.c", "--repeats", "1")
    [row] = result["rows"]
    assert row["source"] == "silu_mul.c" and row["rebuild_s"] > 0 and row["ours_warm_s"] > 0
    assert row["torch_warm_s"] is not None, row.get("torch_error")
