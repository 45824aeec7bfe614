#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test: a virtual environment, once) and runs the whole test suite.
# Extra arguments go to pytest.
set -euo pipefail
export PATH  # see setup.sh
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/setup.sh --test
set +e
"$(llmplatform_python)" -m pytest -q "$@"
code=$?
set -e
# pytest exits 5 when it collected no tests (e.g. a filter matched nothing): not a failure here.
if [[ $code -eq 5 ]]; then exit 0; fi
exit $code
