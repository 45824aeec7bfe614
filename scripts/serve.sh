#!/usr/bin/env bash
# Sets up (scripts/setup.sh: a virtual environment, once) and starts the platform: controller,
# one worker with the embedded default model, the OpenAI-compatible gateway on
# http://127.0.0.1:8000/v1 and the chat web UI on http://127.0.0.1:7860.
# Extra arguments go to `llmplatform serve` (see `llmplatform serve --help`).
set -euo pipefail
export PATH  # see setup.sh
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/setup.sh
exec "$(llmplatform_python)" -m llmplatform.cli serve "$@"
