#!/usr/bin/env bash
# One device call: the first-load probe (torch's load_pt2 against Artifact.load, each in a
# fresh process, on a fresh machine), then the CUDA tests until BUDGET_S (default 540) seconds. Usage: scripts/gpu_load_and_tests.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: scripts/gpu_load_and_tests.sh OUT_DIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/summary.txt"
ART=/tmp/lp/tiny.pt2; mkdir -p /tmp/lp
timeout 150 python3 -m offgraph_export export examples/tiny_llama.py:build -o "$ART" --device cuda --dtype bfloat16 \
  --max-capacity 4096 --max-write 64 > "$OUT/export.log" 2>&1
echo "export rc $? (${SECONDS}s)" | tee -a "$OUT/summary.txt"
for which in torch ours; do
  timeout 120 python3 scripts/load_probe.py "$ART" $which 2>>"$OUT/probe.err" | tee -a "$OUT/summary.txt"
done
echo "probes done (${SECONDS}s)" | tee -a "$OUT/summary.txt"
timeout -k 5 $((${BUDGET_S:-540} - SECONDS)) python3 -m pytest -m cuda -v -rs -p no:cacheprovider --durations=10 \
  tests/test_quantize.py tests/test_quantized_gemv.py tests/test_hostile_round2.py tests/test_decode_method.py tests/test_batched.py \
  tests/test_runtime_input_values.py tests/test_triton_attend.py tests/test_paged_attend.py tests/test_softcap_sinks.py > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc $? (${SECONDS}s): $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_cuda.log" | tail -1); $(grep -c ' PASSED' "$OUT/pytest_cuda.log") PASSED lines" | tee -a "$OUT/summary.txt"
grep -E "(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -20 | tee -a "$OUT/summary.txt"
