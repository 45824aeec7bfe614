#!/usr/bin/env bash
# The GPU check, in one short run (several minutes on one GPU, at most ~20 with every limit hit);
# nothing here installs anything.
#
#   1. the `gpu` tests: the kernel grid, the engine tests on CUDA (eager and replaying CUDA
#      graphs), compiled Triton
#      (tests/kernels, TRITON_INTERPRET unset so the kernels compile)
#   2. benchmarks/kernel_bench.py --quick: Triton vs the torch path vs SDPA, decode bandwidth
#   3. benchmarks/throughput.py --systems ours on CUDA, if the script and its --device flag exist
#   4. benchmarks/gpu_tp_smoke.py: an NCCL process group (engine.parallel), the TP=1 engine on CUDA
#   5. benchmarks/gpu_decode.py: a 1B-shaped random Llama, ours with CUDA graphs vs ours
#      --enforce-eager vs transformers generate at 1 and 32 streams, and the batch-1 decode step
#      against its bandwidth floor (gpu_decode.json)
#
#   benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT if set, else ./gpu_check_out)
#
# Each step has its own time limit and log (OUT_DIR/<step>.log, plus kernels.json,
# throughput.json and gpu_decode.json); a failing step does not stop the others. Exit status: 0 when every step that
# ran passed, else 1. A summary is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET LLMPLATFORM_ATTENTION_BACKEND

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
if not torch.cuda.is_available():
    sys.exit("no CUDA device: every step would skip or fail")
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then exit 1; fi

# 1. All CUDA cases of the kernel tests (the grid, the public ops, the engine test).
step gpu_tests 240 "$PYTHON" -m pytest tests/kernels -m gpu -q -p no:cacheprovider -rs

# 2. Kernel benchmark (quick set of cases).
step kernel_benchmark 150 "$PYTHON" benchmarks/kernel_bench.py --quick --json-out "$OUT_DIR/kernels.json"

# 3. Engine throughput on CUDA: ours only. throughput.py is another component's; skip (not fail)
#    when it or its --device flag is missing.
if [[ ! -f benchmarks/throughput.py ]]; then
  SUMMARY+=("SKIP  throughput (benchmarks/throughput.py not found)")
elif ! "$PYTHON" benchmarks/throughput.py --help 2>/dev/null | grep -q -- "--device"; then
  SUMMARY+=("SKIP  throughput (benchmarks/throughput.py has no --device flag)")
else
  step throughput 180 "$PYTHON" benchmarks/throughput.py --device cuda --systems ours \
    --json-out "$OUT_DIR/throughput.json"
fi

# 4. Tensor-parallel plumbing: an NCCL group of one rank, then the TP=1 engine on CUDA.
step tp_nccl_smoke 180 "$PYTHON" benchmarks/gpu_tp_smoke.py

# 5. Decode on the GPU: CUDA graphs vs eager vs transformers, and the bandwidth floor.
step gpu_decode 420 "$PYTHON" benchmarks/gpu_decode.py --json-out "$OUT_DIR/gpu_decode.json"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.txt"
exit $FAILED
