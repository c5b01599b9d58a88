#!/usr/bin/env bash
# One device call (about 4 minutes): the one-row-per-session paged step on the GPU. Its CUDA
# correctness cases first (tests/test_paged_attend.py -k one_row_per_session), then the paged
# attention sweep with --fold (per layer: today's multi-token step, copies + write + attend +
# combine, against the folded step, attend with the row write and rotary in the kernel + combine),
# pages of 16 and 64, B = 1, 16, 64 at 1k and 8k history.
#   scripts/gpu_fold_probe.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: scripts/gpu_fold_probe.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/summary.txt"
timeout 170 python3 -m pytest -q -m cuda tests/test_paged_attend.py -k one_row_per_session -p no:cacheprovider \
  > "$OUT/pytest_fold.log" 2>&1
echo "pytest rc $?: $(tail -1 "$OUT/pytest_fold.log")" | tee -a "$OUT/summary.txt"
timeout 300 python3 scripts/sweep_paged_attention.py --out "$OUT/sweep_fold.json" --batches 1 16 64 \
  --history 1024 8192 --page-sizes 16 64 --default-only --fold > "$OUT/sweep_fold.log" 2>&1
echo "sweep rc $?" | tee -a "$OUT/summary.txt"
grep -E "pages of|single-session" "$OUT/sweep_fold.log" | tee -a "$OUT/summary.txt"
