"""benchmarks/gpu_check.sh runs on a lent GPU machine that has PyTorch, Triton and transformers but
not the rest of our dependencies nor the default model, for a few minutes a session at most: what
it needs travels in .gpu_carry (benchmarks/gpu_carry.py). Here its steps run on the CPU in a
Python that cannot import what that machine lacks (gpu_carry.IMAGE_LACKS), except the carried
packages, with the default model's tokenizer taken from the carried folder, so a new import or a
new need of the default model fails here rather than on the GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = '''import sys
BLOCKED = {blocked!r}
class _NotOnTheGpuMachine:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, _NotOnTheGpuMachine())
'''


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> Path:
    carry = load_benchmark("gpu_carry")
    out = tmp_path_factory.mktemp("gpu-carry")
    assert carry.main(["--out", str(out), "--no-wheels"]) == 0
    assert (out / "tokenizer" / "tokenizer.json").is_file() and not (out / "wheels").exists()
    return out / "tokenizer"


@pytest.fixture(scope="module")
def gpu_machine_env(tmp_path_factory: pytest.TempPathFactory, carried: Path) -> dict[str, str]:
    carry = load_benchmark("gpu_carry")
    blocked = sorted(set(carry.IMAGE_LACKS) - set(carry.CARRIED.values()))
    site = tmp_path_factory.mktemp("gpu-machine-site")
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT / 'src'}", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "LLMPLATFORM_TEST_TOKENIZER_DIR": str(carried)}
    probe = subprocess.run([sys.executable, "-c", "import fastapi"], env=env, capture_output=True, text=True)
    assert "not on the GPU machine" in probe.stderr  # the blocker is in force
    return env


def run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_tensor_parallel_smoke_runs_with_what_travels(gpu_machine_env, carried):
    out = run(["benchmarks/gpu_tp_smoke.py", "--device", "cpu", "--tokenizer", str(carried)], gpu_machine_env)
    assert "gloo group of 1: all-reduce and gather ok" in out and "TP=1 engine on cpu: 8 tokens" in out


def test_the_decode_benchmark_runs_with_what_travels(gpu_machine_env, carried, tmp_path):
    """benchmarks/gpu_decode.py --smoke: the three systems and the decode-step floor on a tiny random
    Llama, on the CPU (no graphs, and the table says why). Checks what must hold whatever the
    timings: every system produced every token, the ratios are computed against transformers, the
    floor comes from the weights' bytes and a measured bandwidth. Never timings."""
    out = tmp_path / "gpu_decode.json"
    table = run(["benchmarks/gpu_decode.py", "--smoke", "--tokenizer", str(carried), "--json-out", str(out)],
                gpu_machine_env)
    result = json.loads(out.read_text())
    assert result["smoke"] and result["streams"] == [1, 3]
    for system in ("ours_graphs", "ours_eager", "transformers"):
        assert set(result["tokens_per_s"][system]) == {"1", "3"}
        assert all(v > 0 for v in result["tokens_per_s"][system].values())
    assert result["device"] == "cpu" and result["graphs"] is None and "CUDA" in result["graphs_off"]
    # The tiny shape's weights (tied embedding once), in float32 on CPU.
    shape = load_benchmark("gpu_decode").TINY
    per_layer = (shape["hidden_size"] * shape["head_dim"] * (shape["num_attention_heads"]
                 + 2 * shape["num_key_value_heads"]) + shape["num_attention_heads"] * shape["head_dim"]
                 * shape["hidden_size"] + 3 * shape["hidden_size"] * shape["intermediate_size"]
                 + 2 * shape["hidden_size"])
    params = shape["num_hidden_layers"] * per_layer + shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"]
    assert result["parameters"] == params and result["dtype"] == "float32"
    assert result["weight_bytes"] == 4 * params
    assert result["floor_s"] == result["weight_bytes"] / (result["copy_bandwidth_gbps"] * 1e9)
    assert result["step_s"]["ours_graphs"] > 0 and result["step_s"]["ours_eager"] > 0
    assert "transformers generate" in table and "x floor" in table and "1.00x" in table


def test_the_gpu_tests_and_the_kernel_benchmark_import_with_what_travels(gpu_machine_env):
    out = run(["-m", "pytest", "tests/kernels", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
              gpu_machine_env)
    # run() asserted exit 0: pytest exits 2 on any collection error
    assert re.search(r"^[1-9]\d*/\d+ tests collected", out, re.M), out[-500:]
    assert "--quick" in run(["benchmarks/kernel_bench.py", "--help"], gpu_machine_env)
