#!/usr/bin/env bash
# The batched artifact on the GPU machine, in one device call (about 8-9 minutes):
#   1. builds (in the background): the Llama-3.2-1B-shaped config as a batched artifact (64 session
#      slots, pages of 16 rows) and as a single-session one, both --max-autotune none;
#   2. meanwhile the example as a batched cuda artifact (bf16): check --sessions 8 with ordinary
#      launches and with CUDA graphs, run with three prompts == each alone, the paged kernels' tests;
#   3. scripts/measure_batched.py: aggregate decode tokens/s at B = 1, 4, 16, 64 (1k history),
#      batched vs the single-session artifact stepping the sessions in turn; a check of the 1B
#      batched artifact against transformers with CUDA graphs.
# Usage: scripts/gpu_batched.sh OUT_DIR   (everything lands in OUT_DIR; pack it: the device tool
# returns at most 8 files)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_batched.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
ART=/tmp/offgraph_batched
mkdir -p "$ART"
CFG=benchmarks/configs/llama-3.2-1b
status=0
say() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
X="python3 -m offgraph_export"
$X export "hf:$CFG" -o "$ART/b1b.pt2" --device cuda --dtype bfloat16 --max-sessions 64 --page-size 16 \
  --max-capacity 2048 --max-write 256 --max-autotune none --json > "$OUT/export_b1b.log" 2>&1 &
P1=$!
$X export "hf:$CFG" -o "$ART/s1b.pt2" --device cuda --dtype bfloat16 --max-capacity 2048 --max-write 256 \
  --max-autotune none --json > "$OUT/export_s1b.log" 2>&1 &
P2=$!
EX=examples/tiny_llama.py:build
$X export $EX -o "$ART/tiny_b.pt2" --device cuda --dtype bfloat16 --max-sessions 4 --page-size 4 --json > "$OUT/export_tiny.log" 2>&1 || status=1
say "tiny export: $(tail -1 "$OUT/export_tiny.log")"
$X check "$ART/tiny_b.pt2" --model $EX --sessions 8 > "$OUT/check_tiny.txt" 2>&1 || status=1
say "$(head -3 "$OUT/check_tiny.txt" | tr '\n' ' ')"
$X check "$ART/tiny_b.pt2" --model $EX --sessions 8 --cuda-graphs > "$OUT/check_tiny_graphs.txt" 2>&1 || status=1
say "$(head -3 "$OUT/check_tiny_graphs.txt" | tr '\n' ' ')"; grep -m1 "CUDA graphs" "$OUT/check_tiny_graphs.txt" | tee -a "$OUT/summary.txt"
for p in Hello "The capital of France is" x; do
  $X run "$ART/tiny_b.pt2" --model $EX --prompt "$p" --max-new-tokens 12 --json 2>/dev/null
done > "$OUT/run_alone.jsonl"
$X run "$ART/tiny_b.pt2" --model $EX --prompt Hello --prompt "The capital of France is" --prompt x --max-new-tokens 12 \
  --cuda-graphs --json > "$OUT/run_together.json" 2>"$OUT/run_together.log" || status=1
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt" || status=1
import json, sys
out = sys.argv[1]
alone = [json.loads(l)["new_tokens"] for l in open(f"{out}/run_alone.jsonl")]
together = [r["new_tokens"] for r in json.load(open(f"{out}/run_together.json"))]
print("run: three prompts together (CUDA graphs) == each alone (ordinary):", alone == together)
sys.exit(0 if alone == together else 1)
PY
python3 -m pytest -q -m cuda tests/test_paged_attend.py > "$OUT/pytest_cuda.log" 2>&1 || status=1
say "pytest: $(tail -1 "$OUT/pytest_cuda.log")"
wait $P1 || { status=1; say "batched 1B export failed"; tail -3 "$OUT/export_b1b.log"; }
wait $P2 || { status=1; say "single 1B export failed"; tail -3 "$OUT/export_s1b.log"; }
say "1B exports: $(tail -1 "$OUT/export_b1b.log") | $(tail -1 "$OUT/export_s1b.log")"
python3 scripts/measure_batched.py --batched "$ART/b1b.pt2" --single "$ART/s1b.pt2" --config "$CFG" --out "$OUT" \
  > "$OUT/measure.log" 2>&1 || { status=1; tail -5 "$OUT/measure.log"; }
cat "$OUT/batched_table.md" 2>/dev/null | tee -a "$OUT/summary.txt"
if [ "$SECONDS" -lt 500 ]; then
  $X check "$ART/b1b.pt2" --model "hf:$CFG" --sessions 4 --steps 24 --cuda-graphs > "$OUT/check_1b_graphs.txt" 2>&1 || status=1
  say "$(head -3 "$OUT/check_1b_graphs.txt" | tr '\n' ' ')"
else
  say "1B check skipped (time)"
fi
say "status $status"
exit $status
