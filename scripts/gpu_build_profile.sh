#!/usr/bin/env bash
# Where a 1B cuda build's minutes go (issue 27), one device call of at most 10 minutes: the
# benchmark's Llama-3.2-1B-shaped export run through scripts/profile_build.py (every compiler
# process AOTInductor starts, a cProfile of its C++ stage, every Inductor timer), each run with an
# inductor cache of its own (what a fresh machine pays). First alone as `export` builds it; then two
# runs side by side (the C++ compiles are single-threaded processes, the machine has 16 cores):
# AOTInductor's wrapper compiled at -O0 (AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL, torch's knob;
# its default is O1) and without its precompiled header (aot_inductor.precompile_headers=False).
#   scripts/gpu_build_profile.sh OUT_DIR        (BUDGET_S per build, default 250)
#   TOGETHER=1 scripts/gpu_build_profile.sh OUT_DIR   the default and no-header builds at once, no
#       -O0 build (one budget for both: for a device call that has other work)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_build_profile.sh OUT_DIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name --format=csv,noheader; echo "cores $(nproc)"; } | tee "$OUT/summary.txt"
ARGS="hf:benchmarks/configs/llama-3.2-1b --device cuda --dtype bfloat16 --max-capacity 8384 --initial-capacity 1024 --max-write 1024"
status=0
# build NAME [ENV=VALUE...] -- [profile_build.py options]: one profiled export into OUT/build_NAME.{json,log}
build() {
  local name=$1; shift
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  rm -rf "/tmp/bp_$name"; mkdir -p "/tmp/bp_$name"
  env TORCHINDUCTOR_CACHE_DIR="/tmp/bp_$name/cache" "${envs[@]}" timeout -k 5 "${BUDGET_S:-250}" \
    python3 scripts/profile_build.py --out "$OUT/build_$name.json" "$@" -- $ARGS -o "/tmp/bp_$name/1b.pt2" > "$OUT/build_$name.log" 2>&1
  local rc=$?; [ $rc = 0 ] || status=1
  { echo "$name rc $rc"; tail -3 "$OUT/build_$name.log" | cut -c1-1500; } >> "$OUT/summary.txt"
}
# the precompiled headers live outside TORCHINDUCTOR_CACHE_DIR (one set per machine): the first run
# builds them as a fresh machine does; the -O0 run reuses them, the no-header run has none
rm -rf "$(python3 -c 'from torch._inductor.runtime.cache_dir_utils import default_cache_dir as d; print(d())')/precompiled_headers"
if [ "${TOGETHER:-0}" = 1 ]; then
  build default -- &
  build nopch -- --config aot_inductor.precompile_headers=False &
  wait
else
  build default --
  build O0 AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL=O0 -- &
  build nopch -- --config aot_inductor.precompile_headers=False &
  wait
fi
grep -q " rc [1-9]" "$OUT/summary.txt" && status=1
cat "$OUT/summary.txt"
exit $status
