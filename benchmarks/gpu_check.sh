#!/usr/bin/env bash
# The GPU check, in one short run: at most ~9 minutes with every step at its limit, inside one
# device-tool command (10 minutes) and a session's 15 minutes of device time.
#
#   1. benchmarks/gpu_decode.py: a 1B-shaped random Llama, ours with CUDA graphs vs ours
#      --enforce-eager vs transformers generate at 1 and 32 streams, and the batch-1 decode step
#      against its bandwidth floor (gpu_decode.json): what issue 41 asks for, so it runs first
#   2. the `gpu` tests: the kernel grid, the engine tests on CUDA (eager and replaying CUDA
#      graphs), compiled Triton (tests/kernels, TRITON_INTERPRET unset so the kernels compile)
#   3. benchmarks/gpu_tp_smoke.py: an NCCL process group (engine.parallel), the TP=1 engine on CUDA
#   4. benchmarks/kernel_bench.py --quick: Triton vs the torch path vs SDPA, decode bandwidth
#
#   python benchmarks/gpu_carry.py       # here, first: fills .gpu_carry/ (wheels, tokenizer)
#   benchmarks/gpu_check.sh [OUT_DIR]    # there, carrying .gpu_carry (default OUT_DIR: $OUT if
#                                        # set, else ./gpu_check_out)
#
# The GPU machine has PyTorch, Triton and transformers but neither our other dependencies nor the
# default model, and no index to install from: what .gpu_carry holds (benchmarks/gpu_carry.py says
# why each) is installed into a folder of this run's own, and the random models take the default
# model's tokenizer from there. Nothing else is installed. Engine throughput on the default model
# (benchmarks/throughput.py) is not a step: those weights do not travel, and step 1 measures ours
# against transformers.
#
# Each step has its own time limit and log (OUT_DIR/<step>.log, plus gpu_decode.json and
# kernels.json); a failing step does not stop the others. Exit status: 0 when every step that ran
# passed, else 1. A summary is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
CARRY="${GPU_CARRY:-.gpu_carry}"  # benchmarks/gpu_carry.py --out
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET LLMPLATFORM_ATTENTION_BACKEND
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # llmplatform is not installed there
TOKENIZER_ARGS=()
if [[ -d "$CARRY/wheels" ]]; then
  SITE="$(mktemp -d /tmp/gpu-check-site.XXXXXX)"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$CARRY"/wheels/*.whl || { echo "installing $CARRY/wheels failed" >&2; exit 1; }
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if [[ -d "$CARRY/tokenizer" ]]; then
  export LLMPLATFORM_TEST_TOKENIZER_DIR="$(cd "$CARRY/tokenizer" && pwd)"  # tests/conftest.py's tiny models
  TOKENIZER_ARGS=(--tokenizer "$LLMPLATFORM_TEST_TOKENIZER_DIR")
fi

declare -a SUMMARY=()
FAILED=0

step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if [[ $rc -eq 0 ]]; then
    SUMMARY+=("PASS  $name (${took}s)")
  else
    [[ $rc -eq 124 || $rc -eq 137 ]] && rc="$rc (timed out)"
    SUMMARY+=("FAIL  $name (${took}s, exit $rc)")
    FAILED=1
  fi
}

"$PYTHON" - <<'EOF' 2>&1 | tee "$OUT_DIR/environment.log"
import sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton NOT INSTALLED: the Triton steps will fail")
try:
    import llmplatform.engine.llm_engine  # noqa: F401  (what every step imports)
    print("llmplatform's engine imports")
except ImportError as exc:
    print(f"llmplatform's engine does not import: {exc} (was benchmarks/gpu_carry.py run and .gpu_carry carried?)")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: every step would skip or fail")
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then exit 1; fi

# 1. Decode on the GPU: CUDA graphs vs eager vs transformers, and the bandwidth floor.
step gpu_decode 240 "$PYTHON" benchmarks/gpu_decode.py "${TOKENIZER_ARGS[@]}" --json-out "$OUT_DIR/gpu_decode.json"

# 2. All CUDA cases of the kernel tests (the grid, the public ops, the engine tests).
step gpu_tests 180 "$PYTHON" -m pytest tests/kernels -m gpu -q -p no:cacheprovider -rs

# 3. Tensor-parallel plumbing: an NCCL group of one rank, then the TP=1 engine on CUDA.
step tp_nccl_smoke 60 "$PYTHON" benchmarks/gpu_tp_smoke.py "${TOKENIZER_ARGS[@]}"

# 4. Kernel benchmark (quick set of cases).
step kernel_benchmark 60 "$PYTHON" benchmarks/kernel_bench.py --quick --json-out "$OUT_DIR/kernels.json"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.txt"
exit $FAILED
