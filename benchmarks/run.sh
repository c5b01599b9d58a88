#!/usr/bin/env bash
# Decode at the memory floor, side by side (benchmarks/decode_bench.py says what is measured).
# One command on the GPU machine, about 8-10 minutes:
#   benchmarks/run.sh OUT_DIR [decode_bench options, e.g. --history 1024 8192 16384 --steps 100]
# The device tool returns at most 8 files from its $OUT: write into a folder outside it and pack that,
# e.g. `benchmarks/run.sh /tmp/res; tar czf $OUT/res.tgz -C /tmp res` (session 9 lost a run's JSON and traces that way).
# BENCH_VARIANTS picks this project's builds among offgraph (the cuda defaults), offgraph-gemv
# (--no-decode-rope), offgraph-unfused (--no-decode-gemv --no-decode-rope), offgraph-int8 and
# offgraph-int4 (--quantize int8, --quantize int4 --group-size 128); default "offgraph offgraph-unfused".
# Issue 26's run: BENCH_VARIANTS="offgraph offgraph-int8 offgraph-int4" BENCH_GPTFAST="none int4"
# (with BENCH_PHASE=build, then measure).
# BENCH_CHECKS: which variants `check` runs on (default: all of BENCH_VARIANTS).
# BENCH_PHASE=build|measure splits the run over two device calls of at most 10 minutes each: the
# first builds the packages into $BENCH_ARTIFACTS (a folder git ignores, inside the repo, so the
# copy on a still-warm machine keeps it; also TORCHINDUCTOR_CACHE_DIR there for hf-compile), the
# second, made within the machine's idle window, measures. Default: all, in one call.
# The three builds run at once (CPU-bound compiles; their times overlap and are reported as
# such); `check` of this project's packages against transformers with CUDA-graph decode; then
# measurements, one contender at a time (the checks hold the same lock; the gpt-fast-style contender
# of benchmarks/gptfast.py after the others, BENCH_GPTFAST="none int4" for its int4 form too); then the checks with
# ordinary launches while time allows (BENCH_BUDGET_S, default 560 s); then report.py writes OUT_DIR/report.md (and report.png where
# matplotlib is installed). Packages go to $BENCH_ARTIFACTS (default /tmp/offgraph_bench).
set -uo pipefail
OUT=${1:?usage: benchmarks/run.sh OUT_DIR [decode_bench options]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
[ -f scripts/gpu_env.sh ] && source scripts/gpu_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ART=${BENCH_ARTIFACTS:-/tmp/offgraph_bench}
BUDGET=${BENCH_BUDGET_S:-560}
VARIANTS=${BENCH_VARIANTS:-offgraph offgraph-unfused}   # which of this project's builds to measure
CHECKS=${BENCH_CHECKS:-$VARIANTS}   # which of them `check` runs on against transformers (about 70 s each)
PHASE=${BENCH_PHASE:-all}
case "$PHASE" in all|build|measure) ;; *) echo "BENCH_PHASE must be all, build or measure, not '$PHASE'"; exit 2;; esac
mkdir -p "$ART"
ART=$(cd "$ART" && pwd)   # absolute: the inductor cache below and the records live there
# hf-compile's kernels (and their autotuning) come from the inductor caches in the measure call
[ "$PHASE" != all ] && export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ART/inductor-cache}
rm -f "$OUT/.builds_done"
B="python3 benchmarks/decode_bench.py"
CONFIG=benchmarks/configs/llama-3.2-1b
status=0
if [ "$PHASE" = measure ]; then
  # the packages and build records of an earlier BENCH_PHASE=build call on the same (warm) machine
  for variant in $VARIANTS hf_aoti; do
    record="$ART/${variant}_build.json"
    [ -f "$record" ] || { echo "no $record: run BENCH_PHASE=build first, on the same machine (a warm one), with the same BENCH_ARTIFACTS"; exit 2; }
    cp "$record" "$OUT/"
  done
  cp "$ART/hf_compile_build.json" "$OUT/" 2>/dev/null
  $B hf-compile --out "$OUT" --artifacts "$ART" "$@" > "$OUT/hf_compile.log" 2>&1 &
  compile_pid=$!
else
  compile_only=$([ "$PHASE" = build ] && echo --compile-only)
  $B hf-compile $compile_only --out "$OUT" --artifacts "$ART" "$@" > "$OUT/hf_compile.log" 2>&1 &
  compile_pid=$!
  declare -A build_pids
  for variant in $VARIANTS; do
    $B build-offgraph --variant "$variant" --out "$OUT" --artifacts "$ART" "$@" > "$OUT/build_$variant.log" 2>&1 &
    build_pids[$variant]=$!
  done
  $B build-hf-aoti --out "$OUT" --artifacts "$ART" "$@" > "$OUT/build_hf_aoti.log" 2>&1 &
  aoti_pid=$!
  for variant in $VARIANTS; do
    wait "${build_pids[$variant]}" || { status=1; echo "$variant build failed: $OUT/build_$variant.log"; tail -5 "$OUT/build_$variant.log"; }
  done
  wait $aoti_pid || { status=1; echo "hf-aoti build failed: $OUT/build_hf_aoti.log"; tail -5 "$OUT/build_hf_aoti.log"; }
  cp "$OUT"/*_build.json "$ART/" 2>/dev/null
  if [ "$PHASE" = build ]; then
    wait $compile_pid || { status=1; echo "hf-compile failed: $OUT/hf_compile.log"; tail -5 "$OUT/hf_compile.log"; }
    cp "$OUT/hf_compile_build.json" "$ART/" 2>/dev/null
    echo "[$(date +%T) +${SECONDS}s] builds done (BENCH_PHASE=build: measure in the next call, on the same warm machine)"
    exit $status
  fi
fi
touch "$OUT/.builds_done"
echo "[$(date +%T) +${SECONDS}s] builds done"
# check of this project's packages against transformers, holding the measurement lock so no timing
# overlaps it: CUDA-graph decode (what is measured) before measuring, ordinary launches after, as
# time allows
LOCK=$(command -v flock >/dev/null && echo "flock $OUT/.measure.lock")
check_variant() {
  local variant=$1 mode=$2
  if [ -f "$ART/$variant.pt2" ] && [ "$SECONDS" -lt $((BUDGET - 50)) ]; then
    $LOCK python3 -m offgraph_export check "$ART/$variant.pt2" --model "hf:$CONFIG" --steps 8 $mode > "$OUT/check_${variant}${mode}.txt" 2>&1 || status=1
    head -1 "$OUT/check_${variant}${mode}.txt"; grep -m1 "note: methods" "$OUT/check_${variant}${mode}.txt"
  else
    echo "check $variant $mode skipped (time budget)"
  fi
}
for variant in $CHECKS; do check_variant "$variant" --cuda-graphs; done
$B measure --out "$OUT" --artifacts "$ART" "$@" > "$OUT/measure.log" 2>&1 || { status=1; tail -20 "$OUT/measure.log"; }
wait $compile_pid || { status=1; echo "hf-compile failed: $OUT/hf_compile.log"; tail -5 "$OUT/hf_compile.log"; }
# the gpt-fast-style contender (benchmarks/gptfast.py: compiles per cache length, about 2 minutes at
# the 1B shape), as time allows; BENCH_GPTFAST lists its weight forms (default: none, i.e. bf16)
for quant in ${BENCH_GPTFAST-none}; do
  if [ "$SECONDS" -lt $((BUDGET - 200)) ]; then
    python3 benchmarks/gptfast.py --out "$OUT" --quantize "$quant" "$@" > "$OUT/gptfast_$quant.log" 2>&1 \
      || { status=1; echo "gptfast $quant failed: $OUT/gptfast_$quant.log"; tail -5 "$OUT/gptfast_$quant.log"; }
  else
    echo "gptfast $quant skipped (time budget)"
  fi
done
echo "[$(date +%T) +${SECONDS}s] measured"
for variant in $CHECKS; do check_variant "$variant" ""; done
python3 benchmarks/report.py "$OUT" || status=1
echo "[$(date +%T) +${SECONDS}s] status $status"
exit $status
