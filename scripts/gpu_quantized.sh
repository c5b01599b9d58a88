#!/usr/bin/env bash
# Quantized weights on the GPU machine, one device call: the GEMV micro-benchmark
# (scripts/bench_quantized_gemv.py), then the cuda tests of the quantized kernels and artifacts.
#   scripts/gpu_quantized.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: scripts/gpu_quantized.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/summary.txt"
timeout -k 5 ${BENCH_BUDGET_S:-300} python3 scripts/bench_quantized_gemv.py --out "$OUT/quantized_gemv.json" > "$OUT/bench.log" 2>&1
echo "bench rc $?" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/bench.log" >> "$OUT/summary.txt"
timeout -k 5 ${TEST_BUDGET_S:-380} python3 -m pytest -q -m cuda tests/test_quantized_gemv.py tests/test_quantize.py -p no:cacheprovider \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc $?: $(tail -1 "$OUT/pytest_cuda.log")" | tee -a "$OUT/summary.txt"
