#!/usr/bin/env bash
# Decode latency of a Llama-3.2-1B-shaped model (random weights, bf16, batch 1) exported through
# the full pipeline for cuda, at 1k and 16k history, with and without CUDA graphs.
# Usage (GPU machine): scripts/bench_llama1b.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: scripts/bench_llama1b.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
ART=/tmp/offgraph_gpu/llama1b.pt2
python3 -m offgraph_export export examples/tiny_llama.py:build -o "$ART" --device cuda --dtype bfloat16 \
  -a n_layers=16 -a dim=2048 -a n_heads=32 -a n_kv_heads=8 -a head_dim=64 -a hidden_dim=8192 \
  -a vocab_size=128256 -a ring_window=None -a device=cuda \
  --max-capacity 32768 --initial-capacity 1024 --max-write 256 --json 2>&1 | grep -v Warning | tee "$OUT/llama1b_export.log"
python3 scripts/bench_decode.py "$ART" --history 1024 16384 --steps 200 --out "$OUT/llama1b_decode.json" 2>&1 | grep -v Warning
