"""Whether torch's int8 and int4 weight-only CPU kernels (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, in AOTInductor's CPU C shim of torch 2.13) would pay for a
cpu ``.pt2``'s quantized linears (issue 26: "CPU .pt2: dequantize + linear, or torch's int8/int4
CPU kernels where they are faster"). Times, eagerly on this machine's threads, at the SmolLM2-135M
shapes (q|k|v 1152 x 576, o 576 x 576, gate|up 3072 x 576, down 576 x 1536, lm_head 49152 x 576):
the float linear, the int8 kernel (scale applied per row after the sum), the int4 kernel (group
32, weights packed by ``passes/cpu_int4_linear.pack_for_cpu``) and dequantize + linear (what an
exported quantized step computed before those passes, eagerly: the compiled one fuses the
dequantization but still writes the float weight), one row; then the gate|up shape at 1-256 rows.
Median us of 200 (50 for the rows sweep) calls.

    python scripts/bench_cpu_int8_kernel.py --out cpu_int8.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from offgraph_export.passes.cpu_int4_linear import pack_for_cpu
from offgraph_export.reference.weight_quant import quantize

SHAPES = {"qkv": (1152, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    record = {"torch": torch.__version__, "threads": torch.get_num_threads(), "one_row": {}, "rows": {},
              "command": "python scripts/bench_cpu_int8_kernel.py --out cpu_int8.json", "int4_group": 32}
    linear = torch.nn.functional.linear
    for dt in (torch.bfloat16, torch.float32):
        for name, (n, k) in SHAPES.items():
            x, w = torch.randn(1, k, dtype=dt), torch.randn(n, k, dtype=dt)
            q, s = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, dtype=dt)
            stored = quantize(w.float(), "int4", 32)
            packed, sz = pack_for_cpu(stored.qweight, stored.scales.to(dt), stored.zeros.to(dt))
            row = {"linear": median_us(lambda: linear(x, w), 200),
                   "int8pack": median_us(lambda: torch.ops.aten._weight_int8pack_mm(x, q, s), 200),
                   "int4pack": median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz), 200),
                   "dequantize_linear": median_us(lambda: linear(x, (q.float() * s.float()[:, None]).to(dt)), 50)}
            record["one_row"][f"{str(dt).removeprefix('torch.')} {name}"] = row
            print(dt, name, {key: round(v, 1) for key, v in row.items()}, flush=True)
    n, k = SHAPES["gate_up"]
    w, q, s = torch.randn(n, k, dtype=torch.bfloat16), torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16)
    stored = quantize(w.float(), "int4", 32)
    packed, sz = pack_for_cpu(stored.qweight, stored.scales.to(torch.bfloat16), stored.zeros.to(torch.bfloat16))
    for m in (1, 2, 4, 8, 16, 64, 256):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        row = {"linear": median_us(lambda: linear(x, w), 50), "int8pack": median_us(lambda: torch.ops.aten._weight_int8pack_mm(x, q, s), 50),
               "int4pack": median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz), 50)}
        record["rows"][m] = row
        print("bf16 gate_up rows", m, {key: round(v, 1) for key, v in row.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
