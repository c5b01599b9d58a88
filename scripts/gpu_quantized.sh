#!/usr/bin/env bash
# Quantized weights on the GPU machine. Two phases, each one device call of at most 10 minutes:
#   scripts/gpu_quantized.sh packages OUT_DIR   the cuda tests of the quantized artifacts (AOTInductor
#       packages exported and checked: tests/test_quantize.py; three exports of about 100-150 s each,
#       which did not fit the 200 s they had beside the kernels' phase, 2026-12-07)
#   scripts/gpu_quantized.sh kernels OUT_DIR    the GEMV micro-benchmark (scripts/bench_quantized_gemv.py),
#       then the cuda tests of the quantized GEMV kernels
#   scripts/gpu_quantized.sh skinny OUT_DIR     the few-row GEMM's sweep (scripts/bench_skinny_gemm.py: M = 1-16
#       against cuBLAS, the GEMV and tinygemm, int4 in its per-value and "bits" forms), then its cuda tests
# Budgets (seconds): PACKAGE_TEST_BUDGET_S (default 540), BENCH_BUDGET_S (kernels 290, skinny 360),
# TEST_BUDGET_S (kernels 270, skinny 180).
set -uo pipefail
PHASE=${1:?usage: scripts/gpu_quantized.sh packages|kernels|skinny OUT_DIR}
OUT=${2:?usage: scripts/gpu_quantized.sh packages|kernels|skinny OUT_DIR}
case "$PHASE" in packages|kernels|skinny) ;; *) echo "the phase must be packages, kernels or skinny, not '$PHASE'"; exit 2;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$OUT/summary.txt"
status=0
# step BUDGET_S LOG WHAT COMMAND...: COMMAND into OUT/LOG under a time limit, its rc and last line into the summary
step() {
  local budget=$1 log=$2 what=$3; shift 3
  timeout -k 5 "$budget" "$@" > "$OUT/$log" 2>&1
  local rc=$?; [ $rc = 0 ] || status=1
  echo "$what rc $rc: $(tail -1 "$OUT/$log")" | tee -a "$OUT/summary.txt"
}
case "$PHASE" in
packages)
  step ${PACKAGE_TEST_BUDGET_S:-540} pytest_cuda_packages.log "package tests" \
    python3 -m pytest -v -m cuda tests/test_quantize.py -p no:cacheprovider
  grep -E "PASSED|FAILED|ERROR" "$OUT/pytest_cuda_packages.log" | tee -a "$OUT/summary.txt"
  ;;
skinny)
  step ${BENCH_BUDGET_S:-360} skinny.log "skinny sweep" python3 scripts/bench_skinny_gemm.py --out "$OUT/skinny.json"
  tail -2 "$OUT/skinny.log" >> "$OUT/summary.txt"
  step ${TEST_BUDGET_S:-180} pytest_cuda_skinny.log "skinny tests" python3 -m pytest -q -m cuda tests/test_skinny_gemm.py -p no:cacheprovider
  ;;
kernels)
  step ${BENCH_BUDGET_S:-290} bench.log bench python3 scripts/bench_quantized_gemv.py --out "$OUT/quantized_gemv.json"
  tail -3 "$OUT/bench.log" >> "$OUT/summary.txt"
  step ${TEST_BUDGET_S:-270} pytest_cuda.log "kernel tests" python3 -m pytest -q -m cuda tests/test_quantized_gemv.py -p no:cacheprovider
  ;;
esac
exit $status
