"""The C kernels' build cache (``kernels/cbuild.py``) against rebuilding and torch's cpp_extension.

What a user waits for: the first step of a worker that uses the CPU kernels opens every
``csrc/*.c`` library. In one run, for every source:

- ``rebuild``: what a worker would pay at every start without a cache: our compile, into an empty
  cache folder (``$LLMPLATFORM_CACHE`` set to a new temporary folder).
- ``ours warm``: ``cbuild.open_library`` on that now-filled cache, in a fresh process (key hash,
  ownership checks, ``dlopen``), as a restarted worker pays it.
- ``torch cold`` / ``torch warm``: ``torch.utils.cpp_extension.load(..., is_python_module=False)``
  on the same source and flags in its own build folder, first empty then filled (its cache is a
  ninja build folder: a warm load runs ninja to check it is up to date, then loads). It compiles
  with the C++ compiler, so each source is included from a one-line ``extern "C"`` wrapper to
  keep its symbols' C names (a source that does not compile as C++ is reported as such).

Warm numbers are the median of ``--repeats`` fresh processes, each timing only the load (not the
interpreter's start or its imports). Prints a table and a ``RESULT_JSON`` line.

    python benchmarks/infra_cbuild.py [--repeats 3] [--sources rms_norm.c,silu_mul.c]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmplatform.kernels import cbuild

CFLAGS = [flag for flag in cbuild.CFLAGS if flag not in ("-shared", "-fPIC")]

_OURS_WARM = """
import sys, time
from pathlib import Path
from llmplatform.kernels import cbuild
source = Path(sys.argv[1])
started = time.perf_counter()
cbuild.open_library(source)
print(time.perf_counter() - started)
"""

_TORCH_LOAD = """
import sys, time
import torch.utils.cpp_extension as cpp_extension
name, wrapper, folder, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
started = time.perf_counter()
cpp_extension.load(name, [wrapper], extra_cflags=flags, extra_ldflags=["-lm"],
                   is_python_module=False, build_directory=folder, verbose=False)
print(time.perf_counter() - started)
"""


def timed_run(code: str, *args: str, env: dict[str, str]) -> float:
    """Seconds the child reports for its load; raises with the child's stderr on failure."""
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            env=env, timeout=600, check=False)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip()[-1500:])
    return float(result.stdout.strip().splitlines()[-1])


def measure(source: Path, work: Path, repeats: int) -> dict[str, float | str | None]:
    env = dict(os.environ, LLMPLATFORM_CACHE=str(work / "cache"))
    os.environ["LLMPLATFORM_CACHE"] = env["LLMPLATFORM_CACHE"]  # cbuild reads it per call
    cc = cbuild.compiler()
    path = cbuild.library_path(source, cc)
    started = time.perf_counter()
    cbuild.build(source, path, cc)
    rebuild = time.perf_counter() - started
    ours_warm = statistics.median(timed_run(_OURS_WARM, str(source), env=env)
                                  for _ in range(repeats))

    name = f"llmp_{source.stem}"
    folder = work / f"torch-{source.stem}"
    folder.mkdir()
    wrapper = folder / f"{source.stem}_wrapper.cpp"
    wrapper.write_text(f'extern "C" {{\n#include "{source}"\n}}\n', encoding="utf-8")
    args = (name, str(wrapper), str(folder), " ".join(CFLAGS))
    row: dict[str, float | str | None] = {"source": source.name, "rebuild_s": rebuild,
                                          "ours_warm_s": ours_warm}
    try:
        row["torch_cold_s"] = timed_run(_TORCH_LOAD, *args, env=env)
        row["torch_warm_s"] = statistics.median(timed_run(_TORCH_LOAD, *args, env=env)
                                                for _ in range(repeats))
    except RuntimeError as exc:
        row["torch_cold_s"] = row["torch_warm_s"] = None
        row["torch_error"] = str(exc).splitlines()[-1][:200]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sources", default="", help="comma-separated csrc file names (default: all)")
    args = parser.parse_args()
    names = [n for n in args.sources.split(",") if n]
    sources = [cbuild.CSRC / n for n in names] if names else sorted(cbuild.CSRC.glob("*.c"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="infra-cbuild-") as tmp:
        for source in sources:
            work = Path(tmp) / source.stem
            work.mkdir()
            rows.append(measure(source, work, args.repeats))

    def ms(value: float | str | None) -> str:
        return "failed" if value is None else f"{float(value) * 1000:9.1f}"

    print(f"{'source':26} {'rebuild ms':>10} {'ours warm':>10} {'torch cold':>10} {'torch warm':>10}")
    for row in rows:
        print(f"{row['source']:26} {ms(row['rebuild_s']):>10} {ms(row['ours_warm_s']):>10} "
              f"{ms(row['torch_cold_s']):>10} {ms(row['torch_warm_s']):>10}"
              + (f"  ({row['torch_error']})" if "torch_error" in row else ""))
    total = {key: sum(float(r[key]) for r in rows if r.get(key) is not None)
             for key in ("rebuild_s", "ours_warm_s", "torch_warm_s")}
    both = [r for r in rows if r.get("torch_warm_s") is not None]
    print(f"all sources: rebuild {total['rebuild_s']:.2f} s, ours warm {total['ours_warm_s'] * 1000:.1f} ms "
          f"(rebuild / ours warm = {total['rebuild_s'] / total['ours_warm_s']:.0f}x)")
    if both:
        ours = sum(float(r["ours_warm_s"]) for r in both)
        torch_warm = sum(float(r["torch_warm_s"]) for r in both)
        print(f"sources torch builds ({len(both)}): torch warm {torch_warm * 1000:.1f} ms vs ours warm "
              f"{ours * 1000:.1f} ms (torch / ours = {torch_warm / ours:.1f}x)")
    print("RESULT_JSON " + json.dumps({"rows": rows, "totals": total}))


if __name__ == "__main__":
    main()
