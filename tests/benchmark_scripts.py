"""Loading a script of benchmarks/ into the test process, for its smoke test.

benchmarks/ is scripts, not a package: a script imports its siblings by plain name, as when it is
run with ``python benchmarks/X.py``. The folder is on ``sys.path`` only while the script loads.
Left there, its module names (``kernels``, ``embeddings``, ...) would shadow installed packages for
the rest of the test run and for every process spawned from it, which inherits ``sys.path``: a
tensor-parallel rank once imported benchmarks/kernels.py as Hugging Face's ``kernels`` package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module ``bench_<name>``, its siblings imported by plain name."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH_DIR))
        del sys.modules[spec.name]
    return module
