#!/usr/bin/env bash
# Everything the GPU machine checks, in one go:
#   1. the CUDA-marked tests (Triton kernels against the reference, the Triton step through AOTI);
#   2. export + check of the example for cuda in bf16 (flat and ring layers, growth across two
#      boundaries, chunked prefill, ring wrap), with ordinary launches and with CUDA-graph decode;
#   3. benchmarks: decode latency at 1k/16k history with and without CUDA graphs, attention
#      kernel time versus history.
# The device tool returns at most 8 files from its $OUT: write into a folder outside it and pack that,
# e.g. `scripts/gpu_check.sh /tmp/res; tar czf $OUT/res.tgz -C /tmp res` (session 9 lost a run's JSON and traces that way).
# Usage: scripts/gpu_check.sh OUT_DIR [--quick|--no-pytest|--checks-only|--checks-folds|--checks-plain|--pytest-only]
#   (logs and results land in OUT_DIR)
#   --quick: no benchmarks; --no-pytest: no CUDA tests; --checks-only: neither (export + checks only);
#   --checks-folds / --checks-plain: the first / second half of --checks-only (the export with the
#   decode folds, its checks and run; the export without them, its checks and the host overhead);
#   --pytest-only: the CUDA tests alone.
# One device call is limited to 10 minutes: on the H200 (2026-12-02) the CUDA tests take about 5
# minutes, --checks-folds about 6 and --checks-plain about 5; --checks-only (about 11) no longer
# fits one call: make --pytest-only, --checks-folds and --checks-plain three calls.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
MODE=${2:-}
case "$MODE" in ""|--quick|--no-pytest|--checks-only|--checks-folds|--checks-plain|--pytest-only) ;;
  *) echo "unknown mode '$MODE': expected --quick, --no-pytest, --checks-only, --checks-folds, --checks-plain or --pytest-only (or none)" >&2; exit 2;;
esac
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
status=0
step() { echo "== $1" | tee -a "$OUT/summary.txt"; }
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, triton, pydantic
print("torch", torch.__version__, "triton", triton.__version__, "pydantic", pydantic.VERSION)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
PY

case "$MODE" in --checks-*) CHECKS=1 ;; *) CHECKS=0 ;; esac
if [ "$MODE" != "--no-pytest" ] && [ $CHECKS = 0 ]; then
  step "pytest -m cuda"
  python3 -m pytest -m cuda -q -rs tests 2>&1 | tee "$OUT/pytest_cuda.log" | tail -5
  grep -qE "[0-9]+ passed" "$OUT/pytest_cuda.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/pytest_cuda.log" || status=1
fi

if [ "$MODE" = "--pytest-only" ]; then
  echo "gpu_check status: $status" | tee -a "$OUT/summary.txt"
  exit $status
fi

ART=/tmp/offgraph_gpu/tiny_cuda.pt2
if [ "$MODE" != "--checks-plain" ]; then
step "export example for cuda (bf16; defaults: decode method with the GEMV and rotary folds)"
python3 -m offgraph_export export examples/tiny_llama.py:build -o "$ART" --device cuda --dtype bfloat16 \
  --max-capacity 32768 --initial-capacity 16 --max-write 256 --json 2>&1 | tee "$OUT/export.log" || status=1

step "check (ordinary launches)"
python3 -m offgraph_export check "$ART" --model examples/tiny_llama.py:build --steps 24 > "$OUT/check.txt" 2>&1 || status=1
head -4 "$OUT/check.txt" | tee -a "$OUT/summary.txt"
step "check (CUDA-graph decode)"
python3 -m offgraph_export check "$ART" --model examples/tiny_llama.py:build --steps 24 --cuda-graphs > "$OUT/check_graphs.txt" 2>&1 || status=1
head -6 "$OUT/check_graphs.txt" | tee -a "$OUT/summary.txt"

step "run: greedy tokens with ordinary launches == with CUDA-graph decode (Session.reserve before capture)"
python3 -m offgraph_export run "$ART" --model examples/tiny_llama.py:build --tokens 1,2,3,4,5,6,7 --max-new-tokens 40 --json > "$OUT/run.json" 2>"$OUT/run.log" || status=1
python3 -m offgraph_export run "$ART" --model examples/tiny_llama.py:build --tokens 1,2,3,4,5,6,7 --max-new-tokens 40 --cuda-graphs --json > "$OUT/run_graphs.json" 2>"$OUT/run_graphs.log" || status=1
python3 - "$OUT/run.json" "$OUT/run_graphs.json" <<'PY' 2>&1 | tee -a "$OUT/summary.txt" || status=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta, tb = a["new_tokens"], b["new_tokens"]
print("run tokens", ta[:12], "...", len(ta), "| graphs equal:", ta == tb)
sys.exit(0 if ta == tb and len(ta) == 40 else 1)
PY

fi

if [ "$MODE" = "--checks-folds" ]; then
  echo "gpu_check status: $status" | tee -a "$OUT/summary.txt"
  exit $status
fi

PLAIN_ART=/tmp/offgraph_gpu/tiny_cuda_plain.pt2
step "export example for cuda (bf16) without the decode folds (--no-decode-gemv --no-decode-rope: the compiler's GEMMs)"
python3 -m offgraph_export export examples/tiny_llama.py:build -o "$PLAIN_ART" --device cuda --dtype bfloat16 \
  --max-capacity 32768 --initial-capacity 16 --max-write 256 --no-decode-gemv --no-decode-rope --json 2>&1 | tee "$OUT/export_plain.log" || status=1
for mode in "" --cuda-graphs; do
  step "check --no-decode-gemv ${mode:-(ordinary launches)}"
  python3 -m offgraph_export check "$PLAIN_ART" --model examples/tiny_llama.py:build --steps 24 $mode > "$OUT/check_plain${mode}.txt" 2>&1 || status=1
  head -3 "$OUT/check_plain${mode}.txt" | tee -a "$OUT/summary.txt"
done

HOST_ART=$ART; [ -f "$HOST_ART" ] || HOST_ART=$PLAIN_ART   # the folded export where this machine has it
step "host overhead per decode step (prepare + commit; input values alone) of $HOST_ART"
python3 scripts/bench_host_overhead.py "$HOST_ART" --steps 1000 > "$OUT/host_overhead.json" 2>"$OUT/host_overhead.log" || status=1
grep -E "median|device" "$OUT/host_overhead.json" | tee -a "$OUT/summary.txt"

if [ "$MODE" != "--quick" ] && [ $CHECKS = 0 ]; then
  step "graph decode == eager-launch decode"
  python3 scripts/compare_graph_decode.py "$ART" 2>&1 | tee -a "$OUT/summary.txt" || status=1
  step "bench decode"
  python3 scripts/bench_decode.py "$ART" --history 1024 16384 --steps 200 --out "$OUT/bench_decode.json" 2>&1 | tail -4 | tee -a "$OUT/summary.txt" || status=1
  step "bench attention"
  python3 scripts/bench_attention.py --out "$OUT/bench_attention.json" 2>&1 | tee -a "$OUT/summary.txt" || status=1
fi
echo "gpu_check status: $status" | tee -a "$OUT/summary.txt"
exit $status
