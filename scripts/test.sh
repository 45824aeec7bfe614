#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
scripts/setup.sh --test
set +e
"$PYTHON" -m pytest -q "$@"
code=$?
set -e
# pytest exits 5 when it collected no tests (e.g. a filter matched nothing): not a failure here.
if [[ $code -eq 5 ]]; then exit 0; fi
exit $code
