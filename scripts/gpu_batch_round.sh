#!/usr/bin/env bash
# One round of the batched benchmark on the GPU machine, in two device calls made back to back on
# the same warm machine (each under 10 minutes; /tmp survives between them):
#   scripts/gpu_batch_round.sh build OUT_DIR     page-size probe (scripts/sweep_paged_attention.py,
#       default launch settings, pages of 16 and 64, B = 1, 16, 64 at 1k and 8k history), then
#       benchmarks/run_batch.sh's build phase with the page size the probe picked (64 only where
#       it is >= 3% faster at B = 16 and B = 64 at 1k history; recorded in /tmp/page_size), beside
#       the CUDA tests of the attention kernels and the few-row GEMM (CUDA_TESTS names others; PAGE_SIZE=N skips the probe);
#   scripts/gpu_batch_round.sh measure OUT_DIR   the measure phase with the same options, then the
#       few-row GEMM's sweep (scripts/bench_skinny_gemm.py) in the time left, then everything
#       packed into OUT_DIR/bres.tgz (the device tool returns at most 8 files).
# About 6-7 minutes (then the first-load probe, torch's loader against ours, as time allows), then about 9.
set -uo pipefail
PHASE=${1:?usage: scripts/gpu_batch_round.sh build|measure OUT_DIR}
OUT=${2:?usage: scripts/gpu_batch_round.sh build|measure OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
START=$SECONDS
say() { echo "[$(date +%T) +$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
OPTS=(--batches 1 4 16 64 --history 1024 8192 --steps 50)
case "$PHASE" in
build)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$OUT/summary.txt"
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/summary.txt"
  if [ -n "${PAGE_SIZE:-}" ]; then
    echo "$PAGE_SIZE" > /tmp/page_size
    say "page size $PAGE_SIZE given (PAGE_SIZE): no probe"
  else
  timeout 200 python3 scripts/sweep_paged_attention.py --out "$OUT/sweep_pages.json" --batches 1 16 64 \
    --history 1024 8192 --page-sizes 16 64 --default-only > "$OUT/sweep_pages.log" 2>&1
  say "page-size probe rc $?"
  grep "pages of" "$OUT/sweep_pages.log" | tee -a "$OUT/summary.txt"
  PS=$(python3 - "$OUT/sweep_pages.json" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print(16)
    sys.exit()
cases = data["cases"] if isinstance(data, dict) else data
us = {(c["batch"], c["history"], c["page_size"]): c["default_us"] for c in cases}
keys = [(16, 1024), (64, 1024)]
faster = all((b, h, 64) in us and (b, h, 16) in us and us[(b, h, 64)] < 0.97 * us[(b, h, 16)] for b, h in keys)
print(64 if faster else 16)
PY
)
  echo "${PS:-16}" > /tmp/page_size
  say "page size for the build: $(cat /tmp/page_size)"
  fi
  timeout -k 5 540 python3 -m pytest -q -m cuda ${CUDA_TESTS:-tests/test_paged_attend.py tests/test_triton_attend.py tests/test_skinny_gemm.py} -p no:cacheprovider \
    > "$OUT/pytest_cuda.log" 2>&1 &
  tests=$!
  BENCH_PHASE=build benchmarks/run_batch.sh /tmp/batch_round/build "${OPTS[@]}" --page-size "$(cat /tmp/page_size)" \
    > "$OUT/build_call.log" 2>&1
  status=$?
  say "build rc $status"
  wait $tests
  say "pytest rc $?: $(tail -1 "$OUT/pytest_cuda.log")"
  # a fresh process's first load of the single-session package, torch's load_pt2 against ours
  # (scripts/load_probe.py), while the call has time left
  single=/tmp/offgraph_batch_bench/single.pt2
  for which in torch ours; do
    left=$((560 - (SECONDS - START)))
    [ -f "$single" ] && [ $left -gt 20 ] || break
    timeout $left python3 scripts/load_probe.py "$single" $which 2>>"$OUT/probe.err" | tee -a "$OUT/summary.txt"
  done
  tail -20 "$OUT/build_call.log" >> "$OUT/summary.txt"
  tar czf "$OUT/build.tgz" -C /tmp/batch_round build 2>/dev/null
  exit $status
  ;;
measure)
  PS=$(cat /tmp/page_size 2>/dev/null) || { echo "no /tmp/page_size: run the build phase first, on this warm machine"; exit 1; }
  say "page size $PS"
  BENCH_PHASE=measure BENCH_BUDGET_S=510 benchmarks/run_batch.sh /tmp/batch_round/measure "${OPTS[@]}" --page-size "$PS" \
    > "$OUT/measure_call.log" 2>&1
  status=$?
  say "measure rc $status"
  tail -30 "$OUT/measure_call.log" >> "$OUT/summary.txt"
  # the few-row GEMM's sweep (scripts/bench_skinny_gemm.py) in the time the call has left
  left=$((570 - (SECONDS - START)))
  if [ $left -gt 90 ]; then
    timeout $left python3 scripts/bench_skinny_gemm.py --out /tmp/batch_round/measure/skinny.json \
      > /tmp/batch_round/measure/skinny.log 2>&1
    say "skinny GEMM sweep rc $? ($left s allowed)"
    grep "step us per M" /tmp/batch_round/measure/skinny.log | tee -a "$OUT/summary.txt"
  fi
  cp /tmp/batch_round/build/*.json /tmp/batch_round/measure/ 2>/dev/null
  tar czf "$OUT/bres.tgz" -C /tmp/batch_round measure
  exit $status
  ;;
*)
  echo "usage: scripts/gpu_batch_round.sh build|measure OUT_DIR"
  exit 2
  ;;
esac
