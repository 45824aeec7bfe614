"""benchmarks/ runs as scripts, with the folder first on ``sys.path``: its file names must not
shadow a package a library probes for, and loading one into the test process must not leave the
folder on ``sys.path`` for the rest of the run (processes spawned later inherit it)."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmark_scripts import BENCH_DIR, load_benchmark


def test_no_benchmark_script_shadows_an_installed_module():
    """benchmarks/kernels.py once shadowed Hugging Face's ``kernels`` package (a dependency of
    transformers since 5.25): transformers imported the script while loading a model, and a
    tensor-parallel rank failed to start."""
    probe = ("import importlib.util, sys; "
             "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n)))")
    names = sorted(path.stem for path in BENCH_DIR.glob("*.py"))
    shadowed = subprocess.run([sys.executable, "-c", probe, *names], capture_output=True, text=True,
                              timeout=60, check=True, cwd="/").stdout.split()
    assert shadowed == []


def test_transformers_loads_its_kernel_integration_beside_the_scripts():
    probe = "import sys; sys.path.insert(0, sys.argv[1]); import transformers.integrations.hub_kernels"
    done = subprocess.run([sys.executable, "-c", probe, str(BENCH_DIR)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_loading_a_benchmark_leaves_sys_path_as_it_was():
    before = list(sys.path)
    bench = load_benchmark("routing")
    assert callable(bench.main)
    assert sys.path == before and str(BENCH_DIR) not in sys.path
