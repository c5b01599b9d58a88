#!/usr/bin/env bash
# Aggregate decode throughput of B concurrent sessions, side by side (benchmarks/batch_bench.py says
# what is measured): this project's batched artifact, its single-session artifact stepping the B
# sessions in turn, and transformers' static cache at batch B under torch.compile.
#   benchmarks/run_batch.sh OUT_DIR [batch_bench options, e.g. --batches 1 4 16 64 --history 1024 8192 --steps 100]
# Give both phases the same options (they size the packages: --history, --steps, --max-capacity).
# The device tool returns at most 8 files from its $OUT: write into a folder outside it and pack that,
#   benchmarks/run_batch.sh /tmp/bres ...; tar czf $OUT/bres.tgz -C /tmp bres
# BENCH_PHASE=build|measure splits the run over two device calls of at most 10 minutes each, made
# back to back on the same (warm) machine, as benchmarks/run.sh does: the first builds both packages
# and compiles hf-static once per B and cache size (`--hf-cache`; all at once: CPU-bound compiles, their times overlap and are
# reported as such) into $BENCH_ARTIFACTS (default /tmp/offgraph_batch_bench: /tmp survives between
# back-to-back calls; so does a folder the repo's .gitignore ignores, e.g. BENCH_ARTIFACTS=.bench/batch),
# with TORCHINDUCTOR_CACHE_DIR there so the measure call compiles hf-static from its caches; the
# second measures, one contender at a time in one process, the first history whole and the later
# ones while BENCH_BUDGET_S (default 540 s from the script's start) allows, then report_batch.py
# writes OUT_DIR/report.md (and report.png where matplotlib is installed). A build call cut short
# can simply be made again: finished packages and compiles are kept (same command) or come from the
# caches. Default BENCH_PHASE=all: both in one call (a cpu smoke run; on the GPU that is >10 min).
# BENCH_BUILD_TIMEOUT_S (default 570): each build process is stopped after that many seconds.
# BENCH_HF_PARALLEL (default 2): how many hf-static compiles run at once beside the two exports.
set -uo pipefail
OUT=${1:?usage: benchmarks/run_batch.sh OUT_DIR [batch_bench options]}
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
[ -f scripts/gpu_env.sh ] && source scripts/gpu_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)
ART=${BENCH_ARTIFACTS:-/tmp/offgraph_batch_bench}
BUDGET=${BENCH_BUDGET_S:-540}
BUILD_TIMEOUT=${BENCH_BUILD_TIMEOUT_S:-570}
HF_PARALLEL=${BENCH_HF_PARALLEL:-2}
PHASE=${BENCH_PHASE:-all}
case "$PHASE" in all|build|measure) ;; *) echo "BENCH_PHASE must be all, build or measure, not '$PHASE'"; exit 2;; esac
mkdir -p "$ART"
ART=$(cd "$ART" && pwd)   # absolute: the inductor cache and the records live there
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ART/inductor-cache}
BB="python3 benchmarks/batch_bench.py"
status=0
stamp() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*"; }

# the B values among the options (one hf-static build process per B; it compiles each cache size)
batches() {
  local take=0 out=""
  for a in "$@"; do
    case "$a" in
      --batches) take=1 ;;
      --*) take=0 ;;
      *) [ $take = 1 ] && out="$out $a" ;;
    esac
  done
  echo "${out:-1 4 16 64}"
}

if [ "$PHASE" != measure ]; then
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
  T="timeout -k 10 $BUILD_TIMEOUT"
  $T $BB build-single --out "$OUT" --artifacts "$ART" "$@" > "$OUT/build_single.log" 2>&1 &
  single_pid=$!
  $T $BB build-batched --out "$OUT" --artifacts "$ART" "$@" > "$OUT/build_batched.log" 2>&1 &
  batched_pid=$!
  if [[ " $* " == *" --skip "*"hf-static"* ]] || ! python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    stamp "hf-static compiles skipped (no cuda, or --skip hf-static): the measure phase runs it eager on cpu"
    hf_batches=""
  else
    hf_batches=$(batches "$@")
  fi
  running=()
  for b in $hf_batches; do
    if [ ${#running[@]} -ge "$HF_PARALLEL" ]; then
      wait "${running[0]}" || { status=1; echo "hf-static compile failed: see $OUT/build_hf_b*.log"; }
      running=("${running[@]:1}")
    fi
    $T $BB build-hf --batch "$b" --out "$OUT" --artifacts "$ART" "$@" > "$OUT/build_hf_b$b.log" 2>&1 &
    running+=($!)
  done
  for pid in "${running[@]}"; do wait "$pid" || { status=1; echo "an hf-static compile failed: see $OUT/build_hf_b*.log"; }; done
  wait $single_pid || { status=1; echo "single build failed: $OUT/build_single.log"; tail -5 "$OUT/build_single.log"; }
  wait $batched_pid || { status=1; echo "batched build failed: $OUT/build_batched.log"; tail -5 "$OUT/build_batched.log"; }
  grep -h "compiled in\|built already\|wrote" "$OUT"/build_*.log 2>/dev/null | tail -12
  $BB build-summary --out "$OUT" --artifacts "$ART" "$@" > /dev/null 2>&1
  stamp "builds done (status $status)"
  if [ "$PHASE" = build ]; then
    [ $status = 0 ] && echo "BENCH_PHASE=build: measure in the next call, on the same warm machine, with the same options"
    exit $status
  fi
fi

for name in single batched; do
  [ -f "$ART/$name.pt2" ] || { echo "no $ART/$name.pt2: run BENCH_PHASE=build first, on the same (warm) machine, with the same BENCH_ARTIFACTS"; status=1; }
done
[ $status = 0 ] || exit $status
deadline=$(( START + BUDGET ))
stamp "measuring (deadline +${BUDGET}s)"
$BB measure --out "$OUT" --artifacts "$ART" --deadline "$deadline" "$@" 2>&1 | tee "$OUT/measure.log"
[ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "measure failed: $OUT/measure.log"; }
python3 benchmarks/report_batch.py "$OUT" || status=1
stamp "status $status"
exit $status
