"""The few-row GEMM (``kernels/triton_skinny_gemm.py``) against what the steps use today, at the
Llama-3.2-1B projection shapes and M = 1, 2, 4, 8, 16 rows (the batched step's decode tokens).

Each measurement is one projection of 16 layers (each on its own weights, so they do not sit in
L2; the lm_head 4 copies), captured in one CUDA graph and replayed: the median replay over the
copies is one call's time, as a step pays it. Side by side, per shape and M: bf16 through cuBLAS
(``F.linear``: the sessions method's projections today), this project's one-row GEMV at M = 1
(bf16, int8, int4 g128; no folds), tinygemm int4 (``aten._weight_int4pack_mm``) at every M, and the
skinny GEMM's launches (:data:`SKINNY_CONFIGS`) over bf16, int8 and int4 g128 (int4 in both of its
forms: per value, and ``dequant="bits"``, "int4bits"). Also the step sums
(16 layers of each projection plus the lm_head) per M, for cuBLAS bf16 and the skinny GEMM's
fastest launch per projection, with % of the weights' floor at the measured copy rate.

    python scripts/bench_skinny_gemm.py --out skinny.json        # measures (about 2-3 minutes), its .md beside it (skinny.md)
    python scripts/bench_skinny_gemm.py --report skinny.json     # skinny.md from a recorded run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_attention import copy_rate, replay_us  # scripts/, the script's own folder

from offgraph_export.kernels import triton_gemv as tg
from offgraph_export.kernels.triton_skinny_gemm import SKINNY_CONFIGS, skinny_gemm
from offgraph_export.reference.weight_quant import quantize

LAYERS = 16
DT = torch.bfloat16
GROUP = 128
ROWS = (1, 2, 4, 8, 16)
SHAPES = {  # name: (N, K, copies)
    "qkv": (3072, 2048, LAYERS),
    "o": (2048, 2048, LAYERS),
    "gate|up": (16384, 2048, LAYERS),
    "down": (2048, 8192, LAYERS),
    "lm_head": (128256, 2048, 4),
}
SCHEMES = ("bf16", "int8", "int4")
#: the skinny GEMM's forms swept: name -> (the weights it reads, its ``dequant``)
FORMS = {"bf16": ("bf16", "value"), "int8": ("int8", "value"), "int4": ("int4", "value"), "int4bits": ("int4", "bits")}


def _name(config: tuple[int, int, int, int]) -> str:
    bn, bk, warps, stages = config
    return f"{bn}x{bk}w{warps}s{stages}"


def measure_shape(name: str, n: int, k: int, copies: int) -> dict:
    """Every contender's us per call at each M for one projection shape."""
    ws = [torch.randn(n, k, device="cuda", dtype=DT) / k**0.5 for _ in range(copies)]
    stored = {s: [quantize(w, s, GROUP if s == "int4" else None) for w in ws] for s in ("int8", "int4")}
    nbytes = {"bf16": n * k * 2} | {s: sum(t.numel() * t.element_size() for t in v[0].tensors().values()) for s, v in stored.items()}
    packed = []
    try:
        for s in stored["int4"]:
            weight = torch.ops.aten._convert_weight_to_int4pack(s.qweight.contiguous(), 8)
            packed.append((weight, torch.stack([s.scales.t(), s.zeros.t()], dim=-1).contiguous()))
    except Exception as exc:  # noqa: BLE001 - tinygemm may be missing on this build; say so
        print(f"  tinygemm packing {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    row = {"shape": name, "n": n, "k": k, "copies": copies, "bytes": nbytes, "us": {}}
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=DT)
        us = {"cublas_bf16": replay_us(lambda: [torch.nn.functional.linear(x, w) for w in ws], copies)}
        if m == 1:
            xv = x.reshape(1, 1, k)
            us["gemv_bf16"] = replay_us(lambda: [tg.gemv_launch(xv, w) for w in ws], copies)
            for scheme in ("int8", "int4"):
                us[f"gemv_{scheme}"] = replay_us(lambda: [
                    tg.gemv_launch(xv, s.qweight, scales=s.scales, zeros=s.zeros, group_size=s.group_size or 0)
                    for s in stored[scheme]], copies)
        if packed:
            us["tinygemm_int4"] = replay_us(lambda: [torch.ops.aten._weight_int4pack_mm(x, wp, GROUP, sz) for wp, sz in packed], copies)
        for config in SKINNY_CONFIGS:
            for form, (scheme, dequant) in FORMS.items():
                key = f"skinny_{form}_{_name(config)}"
                try:
                    if scheme == "bf16":
                        us[key] = replay_us(lambda: [skinny_gemm(x, w, config=config) for w in ws], copies)
                    else:
                        us[key] = replay_us(lambda: [skinny_gemm(x, s.qweight, s.scales, s.zeros, s.group_size or 0, config=config,
                                                                 dequant=dequant) for s in stored[scheme]], copies)
                except Exception as exc:  # noqa: BLE001 - a launch may not compile; say so
                    print(f"  {name} M={m} {key}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        for scheme in FORMS:
            options = {key: v for key, v in us.items() if key.startswith(f"skinny_{scheme}_")}
            if options:
                best = min(options, key=options.get)
                us[f"skinny_{scheme}_best"] = options[best]
                us[f"skinny_{scheme}_best_launch"] = best.removeprefix(f"skinny_{scheme}_")
        row["us"][str(m)] = us
        print(name, f"M={m}", {key: (round(v, 2) if isinstance(v, float) else v) for key, v in us.items()
                               if not key.startswith("skinny_") or "best" in key}, flush=True)
    del ws, stored, packed
    torch.cuda.empty_cache()
    return row


def report(data: dict) -> str:
    rate = data["copy_bytes_per_s"]
    lines = [f"# Few-row GEMM at the 1B shapes, {data['device']}, torch {data['torch']}", "",
             f"Copy rate {rate / 1e12:.2f} TB/s; one projection of 16 layers (lm_head 4 copies) per CUDA graph, "
             "median us per call; `scripts/bench_skinny_gemm.py`.", ""]
    for row in data["rows"]:
        lines += [f"## {row['shape']} ({row['n']} x {row['k']})", "",
                  "| M | cuBLAS bf16 | skinny bf16 (launch) | GEMV bf16 | skinny int8 | GEMV int8 | skinny int4 | skinny int4 bits (launch) | GEMV int4 | tinygemm int4 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for m, us in row["us"].items():
            def cell(key: str) -> str:
                return f"{us[key]:.2f}" if key in us else "-"
            lines.append(f"| {m} | {cell('cublas_bf16')} | {cell('skinny_bf16_best')} ({us.get('skinny_bf16_best_launch', '-')}) | "
                         f"{cell('gemv_bf16')} | {cell('skinny_int8_best')} | {cell('gemv_int8')} | {cell('skinny_int4_best')} | "
                         f"{cell('skinny_int4bits_best')} ({us.get('skinny_int4bits_best_launch', '-')}) | "
                         f"{cell('gemv_int4')} | {cell('tinygemm_int4')} |")
        lines.append("")
    lines += ["## Projections of a step (16 layers + lm_head), us, and % of the weights' floor", "",
              "| M | cuBLAS bf16 | skinny bf16 | skinny int8 | skinny int4 | skinny int4 bits | tinygemm int4 (lm_head and gate\\|up too) |",
              "|---|---|---|---|---|---|---|"]
    for m, step in data["step_us"].items():
        cells = []
        for key, scheme in (("cublas_bf16", "bf16"), ("skinny_bf16_best", "bf16"), ("skinny_int8_best", "int8"),
                            ("skinny_int4_best", "int4"), ("skinny_int4bits_best", "int4"), ("tinygemm_int4", "int4")):
            if key in step:
                floor = data["weight_bytes"][scheme] / rate * 1e6
                cells.append(f"{step[key]:.1f} ({100 * floor / step[key]:.0f}%)")
            else:
                cells.append("-")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="measure on the GPU and write the JSON here (its .md beside it (skinny.md))")
    parser.add_argument("--report", help="only render the report (.md) beside this recorded JSON")
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), help="a subset of the shapes (default: all)")
    args = parser.parse_args()
    if args.report:
        data = json.loads(Path(args.report).read_text())
        Path(args.report).with_suffix(".md").write_text(report(data))
        return
    if not args.out:
        parser.error("give --out (measure) or --report (render a recorded run)")
    started = time.time()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows = [measure_shape(name, *SHAPES[name]) for name in (args.shapes or SHAPES)]
    step: dict[str, dict[str, float]] = {}
    weights = {s: sum(r["bytes"][s] * (1 if r["shape"] == "lm_head" else LAYERS) for r in rows) for s in SCHEMES}
    for m in map(str, ROWS):
        step[m] = {}
        for key in ("cublas_bf16", "skinny_bf16_best", "skinny_int8_best", "skinny_int4_best", "skinny_int4bits_best", "tinygemm_int4"):
            if all(key in r["us"][m] for r in rows):
                step[m][key] = sum(r["us"][m][key] * (1 if r["shape"] == "lm_head" else LAYERS) for r in rows)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": rate,
           "rows": rows, "step_us": step, "weight_bytes": weights, "seconds": time.time() - started}
    Path(args.out).write_text(json.dumps(out, indent=2))
    Path(args.out).with_suffix(".md").write_text(report(out))
    print("step us per M:", {m: {k: round(v, 1) for k, v in s.items()} for m, s in step.items()}, flush=True)


if __name__ == "__main__":
    main()
