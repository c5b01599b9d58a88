#!/usr/bin/env bash
# Where a 1B cuda build's minutes go (issue 27), one device call of at most 10 minutes: the
# benchmark's Llama-3.2-1B-shaped export run standalone through scripts/profile_build.py (every
# compiler process AOTInductor starts, a cProfile of its C++ stage, every Inductor timer), each with
# an inductor cache of its own (what a fresh machine pays), first as `export` builds it, then with
# AOTInductor's wrapper compiled at -O0 (AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL, torch's own knob),
# to see what the wrapper's optimization costs.
#   scripts/gpu_build_profile.sh OUT_DIR        (BUDGET_S per build, default 270)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_build_profile.sh OUT_DIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/summary.txt"
nproc >> "$OUT/summary.txt"
ARGS="hf:benchmarks/configs/llama-3.2-1b --device cuda --dtype bfloat16 --max-capacity 8384 --initial-capacity 1024 --max-write 1024"
status=0
for run in default O0; do
  rm -rf "/tmp/bp_$run"; mkdir -p "/tmp/bp_$run"
  level=O1; [ $run = O0 ] && level=O0  # torch's default is O1
  env TORCHINDUCTOR_CACHE_DIR="/tmp/bp_$run/cache" AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL=$level \
    timeout -k 5 "${BUDGET_S:-270}" python3 scripts/profile_build.py --out "$OUT/build_$run.json" -- $ARGS -o "/tmp/bp_$run/1b.pt2" \
    > "$OUT/build_$run.log" 2>&1
  rc=$?; [ $rc = 0 ] || status=1
  echo "$run rc $rc" >> "$OUT/summary.txt"; tail -3 "$OUT/build_$run.log" | cut -c1-2000 >> "$OUT/summary.txt"
done
exit $status
