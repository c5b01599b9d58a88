#!/usr/bin/env bash
# Programmatic dependent launch on the GPU machine, one device call of a few minutes:
# scripts/bench_pdl.py (the decode chain of 16 layers off / code / pdl / edges, bf16, int8, int4)
# then the cuda tests of PDL launches (tests/test_quantized_gemv.py -k pdl).
#   scripts/gpu_pdl.sh OUT_DIR        (BENCH_BUDGET_S default 220, TEST_BUDGET_S default 90)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_pdl.sh OUT_DIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)'; } | tee "$OUT/summary.txt"
status=0
(cd scripts && timeout -k 5 "${BENCH_BUDGET_S:-220}" python3 bench_pdl.py --out "$OUT/pdl.json") > "$OUT/pdl.log" 2>&1 || status=1
tail -4 "$OUT/pdl.log" | tee -a "$OUT/summary.txt"
timeout -k 5 "${TEST_BUDGET_S:-90}" python3 -m pytest -q -m cuda tests/test_quantized_gemv.py -k pdl -p no:cacheprovider > "$OUT/pytest_pdl.log" 2>&1 || status=1
tail -2 "$OUT/pytest_pdl.log" | tee -a "$OUT/summary.txt"
exit $status
