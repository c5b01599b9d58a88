#!/usr/bin/env bash
# The transformers frontend on the GPU machine, side by side with the factory-built model of the
# same shape (Llama-3.2-1B: 16 layers, dim 2048, 32/8 heads, head dim 64, FFN 8192, vocab 128256;
# random bf16 weights, batch 1, all flat):
#   1. export hf:benchmarks/configs/llama-3.2-1b for cuda in bf16, and examples/tiny_llama.py:build
#      with the same shape;
#   2. check the hf artifact against transformers itself (ordinary launches, then CUDA graphs);
#   3. decode latency of both at 1k and 16k history, with and without CUDA graphs, in one run.
# Usage (GPU machine): scripts/bench_hf_llama1b.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: scripts/bench_hf_llama1b.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
status=0
CACHE=(--max-capacity 32768 --initial-capacity 1024 --max-write 256)
HF=/tmp/offgraph_gpu/hf_llama1b.pt2
FACTORY=/tmp/offgraph_gpu/factory_llama1b.pt2
python3 -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)' | tee "$OUT/env.txt"
echo "== export hf" | tee -a "$OUT/summary.txt"
python3 -m offgraph_export export hf:benchmarks/configs/llama-3.2-1b -o "$HF" --device cuda --dtype bfloat16 \
  "${CACHE[@]}" --json 2>&1 | grep -v Warning | tee "$OUT/export_hf.log" | tail -1 | tee -a "$OUT/summary.txt" || status=1
echo "== export factory" | tee -a "$OUT/summary.txt"
python3 -m offgraph_export export examples/tiny_llama.py:build -o "$FACTORY" --device cuda --dtype bfloat16 \
  -a n_layers=16 -a dim=2048 -a n_heads=32 -a n_kv_heads=8 -a head_dim=64 -a hidden_dim=8192 \
  -a vocab_size=128256 -a ring_window=None -a device=cuda \
  "${CACHE[@]}" --json 2>&1 | grep -v Warning | tee "$OUT/export_factory.log" | tail -1 | tee -a "$OUT/summary.txt" || status=1
echo "== check hf against transformers" | tee -a "$OUT/summary.txt"
python3 -m offgraph_export check "$HF" --model hf:benchmarks/configs/llama-3.2-1b --steps 8 > "$OUT/check_hf.txt" 2>&1 || status=1
head -4 "$OUT/check_hf.txt" | tee -a "$OUT/summary.txt"
python3 -m offgraph_export check "$HF" --model hf:benchmarks/configs/llama-3.2-1b --steps 8 --cuda-graphs > "$OUT/check_hf_graphs.txt" 2>&1 || status=1
head -6 "$OUT/check_hf_graphs.txt" | tee -a "$OUT/summary.txt"
echo "== decode, side by side" | tee -a "$OUT/summary.txt"
python3 scripts/bench_decode.py "$HF" "$FACTORY" --history 1024 16384 --steps 200 --out "$OUT/decode.json" 2>&1 \
  | grep -v Warning | tee -a "$OUT/summary.txt" || status=1
echo "status: $status" | tee -a "$OUT/summary.txt"
exit $status
