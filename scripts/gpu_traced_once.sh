#!/usr/bin/env bash
# One device call (about 5 minutes): the pt2 export without the functionalize pass's own trace
# (passes/functionalize.py, lowering_traces), checked on cuda where the Triton step, its one-token
# kernels, the GEMV and rotary folds and the paged step are decomposed by AOTInductor's trace alone:
#   1. the example for cuda (bf16, defaults: decode method with the folds): export, check with
#      ordinary launches and with CUDA graphs; the same export with the pass as before (the
#      functional programs), its passes and compile timed beside;
#   2. the example as a batched artifact (--max-sessions 4, pages of 4): check --sessions 8, ordinary
#      launches and CUDA graphs (the sessions method too);
#   3. a tiny transformers Llama (hf): export and check against transformers with CUDA graphs.
# Usage: scripts/gpu_traced_once.sh OUT_DIR   (QUICK=1: 1 and 2 with CUDA graphs only, about 4 minutes)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_traced_once.sh OUT_DIR}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
status=0
ART=/tmp/traced_once; mkdir -p "$ART"
EX=examples/tiny_llama.py:build
X="python3 -m offgraph_export"
verdict() { grep -m1 -E "^check .*: (PASSED|FAILED)" "$1" || tail -1 "$1"; }
say() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/summary.txt"
$X export $EX -o "$ART/tiny.pt2" --device cuda --dtype bfloat16 --max-capacity 4096 --initial-capacity 16 \
  --max-write 64 --json > "$OUT/export.json" 2> "$OUT/export.log"
rc=$?; [ $rc = 0 ] || status=1
say "export (AOTInductor's trace alone) rc $rc: $(grep -E 'passes done|compiled in' "$OUT/export.log" | tr '\n' ' ')"
$X check "$ART/tiny.pt2" --model $EX --steps 24 > "$OUT/check.txt" 2>&1 || status=1
say "check ordinary: $(verdict "$OUT/check.txt")"
$X check "$ART/tiny.pt2" --model $EX --steps 24 --cuda-graphs > "$OUT/check_graphs.txt" 2>&1 || status=1
say "check graphs: $(verdict "$OUT/check_graphs.txt")"
$X export $EX -o "$ART/tiny_b.pt2" --device cuda --dtype bfloat16 --max-sessions 4 --page-size 4 --json \
  > "$OUT/export_b.json" 2> "$OUT/export_b.log"
rc=$?; [ $rc = 0 ] || status=1
say "batched export rc $rc: $(grep -E 'passes done|compiled in' "$OUT/export_b.log" | tr '\n' ' ')"
if [ -z "${QUICK:-}" ]; then
$X check "$ART/tiny_b.pt2" --model $EX --sessions 8 > "$OUT/check_b.txt" 2>&1 || status=1
say "check --sessions 8: $(verdict "$OUT/check_b.txt")"
fi
$X check "$ART/tiny_b.pt2" --model $EX --sessions 8 --cuda-graphs > "$OUT/check_b_graphs.txt" 2>&1 || status=1
say "check --sessions 8 --cuda-graphs: $(verdict "$OUT/check_b_graphs.txt")"
[ -n "${QUICK:-}" ] && { say "status $status (QUICK)"; exit $status; }
# the same example export with the functional programs, as before the change (timings beside)
python3 - "$ART/tiny_old.pt2" > "$OUT/export_old.json" 2> "$OUT/export_old.log" <<'PY'
import sys
import offgraph_export.pipeline as pipeline
from offgraph_export.passes.functionalize import functionalize
pipeline.functionalize = lambda program, lowering_traces=False: functionalize(program)
from offgraph_export.cli.main import cli
cli(["export", "examples/tiny_llama.py:build", "-o", sys.argv[1], "--device", "cuda", "--dtype", "bfloat16",
     "--max-capacity", "4096", "--initial-capacity", "16", "--max-write", "64", "--json"])
PY
rc=$?; [ $rc = 0 ] || status=1
say "export (functional programs, as before) rc $rc: $(grep -E 'passes done|compiled in' "$OUT/export_old.log" | tr '\n' ' ')"
python3 - "$ART" > "$OUT/hf_llama.log" 2>&1 <<'PY' || status=1
import sys, transformers
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
transformers.LlamaForCausalLM(cfg).save_pretrained(sys.argv[1] + "/llama")
PY
$X export "hf:$ART/llama" -o "$ART/llama.pt2" --device cuda --dtype bfloat16 --max-write 32 > "$OUT/export_hf.log" 2>&1
rc=$?; [ $rc = 0 ] || status=1
say "hf export rc $rc"
$X check "$ART/llama.pt2" --model "hf:$ART/llama" --steps 12 --cuda-graphs > "$OUT/check_hf_graphs.txt" 2>&1 || status=1
say "hf check graphs: $(verdict "$OUT/check_hf_graphs.txt")"
say "status $status"
exit $status
