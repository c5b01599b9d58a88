#!/usr/bin/env bash
# Quantized weights on the GPU machine, one device call: the cuda tests of the quantized artifacts
# (AOTInductor packages through check: tests/test_quantize.py) first, then the GEMV micro-benchmark
# (scripts/bench_quantized_gemv.py), then the cuda tests of the quantized GEMV kernels.
#   scripts/gpu_quantized.sh OUT_DIR
# Budgets (seconds): PACKAGE_TEST_BUDGET_S (default 200), BENCH_BUDGET_S (260), TEST_BUDGET_S (120).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_quantized.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/summary.txt"
timeout -k 5 ${PACKAGE_TEST_BUDGET_S:-200} python3 -m pytest -q -m cuda tests/test_quantize.py -p no:cacheprovider \
  > "$OUT/pytest_cuda_packages.log" 2>&1
echo "package tests rc $?: $(tail -1 "$OUT/pytest_cuda_packages.log")" | tee -a "$OUT/summary.txt"
timeout -k 5 ${BENCH_BUDGET_S:-260} python3 scripts/bench_quantized_gemv.py --out "$OUT/quantized_gemv.json" > "$OUT/bench.log" 2>&1
echo "bench rc $?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/bench.log" >> "$OUT/summary.txt"
timeout -k 5 ${TEST_BUDGET_S:-120} python3 -m pytest -q -m cuda tests/test_quantized_gemv.py -p no:cacheprovider \
  > "$OUT/pytest_cuda.log" 2>&1
echo "kernel tests rc $?: $(tail -1 "$OUT/pytest_cuda.log")" | tee -a "$OUT/summary.txt"
