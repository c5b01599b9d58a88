"""The decode GEMV over int8 / int4 weights against bf16, at the Llama-3.2-1B projection shapes.

Each measurement is one projection of 16 layers (each on its own weights, so they do not sit in
L2), captured in one CUDA graph and replayed: the median replay over 16 is one call's time, as a
decode step pays it. Per shape, side by side: bf16 through cuBLAS (``F.linear``) and through this
project's GEMV (``kernels/triton_gemv.py``, where its width limit admits it), int8 and int4
(group 128) through the same GEMV with its folds (default launch configuration and a few others),
three forms of dequantization (per row or group, the default; per value, ``"dequant": "value"``;
per row or group without an int-to-float conversion a value, ``"dequant": "bits"``, swept over the
rows and tiles kernels' launches, and the same with ``"x": "split"``, the chunk's ``x`` read once
and split into the words' field positions in registers, as int4's per-group rows launches split it
into their even and odd columns), int4 on the tensor cores (``"kernel": "mma"``,
"mma"), and, for int4 without folds, tinygemm
(``aten._weight_int4pack_mm``, the kernel gpt-fast's int4 path uses) as the contender. The step
sums 16 layers of each projection plus the lm_head; the floor is the weights' bytes at the measured
device copy rate.

    python scripts/bench_quantized_gemv.py --out quantized_gemv.json     # measures, writes report.md beside it
    python scripts/bench_quantized_gemv.py --report quantized_gemv.json  # report.md from a recorded run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench_attention import copy_rate, replay_us  # scripts/, the script's own folder

from offgraph_export.kernels import triton_gemv as tg
from offgraph_export.reference.weight_quant import quantize

LAYERS = 16
DT = torch.bfloat16
SHAPES = {  # name: (weight rows N, K, norm, gated, residual, copies)
    "qkv+norm": (3072, 2048, True, False, False, LAYERS),
    "o+residual": (2048, 2048, False, False, True, LAYERS),
    "gate|up+norm+silu*mul": (16384, 2048, True, True, False, LAYERS),
    "down+residual": (2048, 8192, False, False, True, LAYERS),
    "lm_head+norm": (128256, 2048, True, False, False, 4),
}
#: (BLOCK_N, BLOCK_K, warps). More rows a program amortize what every program reloads whatever
#: its rows (x, the norm's weight, the rstd pass: 6 bytes a column against a quarter or half a byte
#: a column a weight row), so the quantized sweep goes to 32 rows.
CONFIGS = [(1, 1024, 4), (2, 1024, 4), (4, 1024, 4), (2, 2048, 4), (4, 2048, 8), (8, 512, 4),
           (8, 1024, 8), (16, 256, 4), (16, 512, 4), (16, 512, 8), (32, 256, 8)]
#: The persistent row-tile kernel over quantized rows: (BLOCK_N, programs per SM, warps, stages).
#: It prepares x (the norm, int4's even/odd split and group sums) once a program instead of once
#: every BLOCK_N rows; it holds a whole row, so rows up to TILES_MAX_K columns. Each swept per row or
#: group ("tiles") and with "dequant": "bits" ("tilesbits").
TILE_CONFIGS = [(1, 4, 4, 3), (2, 4, 4, 3), (4, 4, 4, 3), (4, 2, 8, 3), (8, 2, 8, 2), (8, 4, 8, 2)]
#: The rows kernel's launches swept with "x": "split" too ("bitsx", and int4 per group "groupx"; the tiles kernel's: "tilesbitsx",
#: all of TILE_CONFIGS): those near the fastest "bits" launches of the last sweep
#: (``benchmarks/h100-2026-12-07-quantized-step/gemv``).
SPLIT_CONFIGS = [(4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (16, 512, 4)]
#: The tensor-core kernel's int4 launches ("mma"): (BLOCK_N, BLOCK_K, warps, stages); 16-32 rows a
#: program keep 64-192 programs at 2048-3072 outputs.
MMA_CONFIGS = [(16, 128, 4, 2), (16, 256, 4, 3), (32, 128, 4, 2), (32, 256, 4, 3), (64, 128, 4, 3), (64, 256, 8, 3)]
TILES_MAX_K = 8192
GROUP = 128


VARIANTS = {  # step variant: the weights it reads
    "cublas_bf16": "bf16", "gemv_bf16": "bf16", "gemv_int8": "int8", "gemv_int8_pervalue": "int8",
    "gemv_int4": "int4", "gemv_int4_pervalue": "int4", "tinygemm_int4": "int4",
    "gemv_int8_best": "int8", "gemv_int4_best": "int4", "gemv_int8_bits_best": "int8", "gemv_int4_bits_best": "int4",
    "gemv_int8_split_best": "int8", "gemv_int4_split_best": "int4", "gemv_int4_mma_best": "int4",
}  # *_best: for each projection the fastest launch measured for it (what a default tuned on this run gives) of
#    the forms the default may take (per row or group: the rows and tiles kernels); *_bits_best: the fastest
#    "bits" launch of the rows and tiles kernels; *_split_best: the fastest launch with "x": "split" (bits on
#    both kernels, int4's per-group rows); gemv_int4_mma_best: the fastest tensor-core launch
FORMS = ("plain", "bits", "split", "mma")


def _form(key: str) -> str:
    """A measured launch's form: "mma" (``gemv_int4_mma_*``), "split" (``"x": "split"``:
    ``gemv_{scheme}_bitsx_*``, ``_tilesbitsx_*``, ``gemv_int4_groupx_*``), "bits" (``_bits_*``,
    ``_tilesbits_*``) or "plain" (per row or group, per value)."""
    if "_mma_" in key:
        return "mma"
    if "_bitsx_" in key or "_tilesbitsx_" in key or "_groupx_" in key:
        return "split"
    return "bits" if "_bits_" in key or "_tilesbits_" in key else "plain"


def _best_of(us: dict, scheme: str, form: str) -> str | None:
    """The fastest launch measured of ``scheme`` in ``form`` (:func:`_form`; rows and tiles
    kernels), per value left out: "plain" is what ``_best`` took before "bits" was swept."""
    options = {key: t for key, t in us.items() if key.startswith(f"gemv_{scheme}") and "pervalue" not in key
               and not key.endswith("_best") and _form(key) == form}
    return min(options, key=options.get) if options else None


def report(data: dict) -> str:
    """report.md: per projection us per call, and the step (16 layers + lm_head) in us beside its
    % of the floor (the bytes that variant reads at the run's copy rate)."""
    rate = data["copy_bytes_per_s"]
    lines = [
        "# Decode GEMV over quantized weights, Llama-3.2-1B shapes",
        "",
        f"{data['device']}, torch {data['torch']}; copy rate {rate / 1e12:.2f} TB/s (a 1 GiB copy, "
        "read + write). One projection of 16 layers (lm_head: of several copies) in one CUDA graph, median us per call.",
        "",
        "| projection | " + " | ".join(VARIANTS) + " |",
        "|---|" + "---|" * len(VARIANTS),
    ]
    for row in data["rows"]:
        shape = row["shape"].replace("|", "\\|")
        lines.append(f"| {shape} | " + " | ".join(
            f"{row['us'][v]:.2f}" if v in row["us"] else "-" for v in VARIANTS) + " |")
    lines += ["", "| step: 16 layers + lm_head | us | weight bytes | floor us | % of floor |", "|---|---|---|---|---|"]
    for variant, weights in VARIANTS.items():
        if variant not in data["step_us"]:
            continue
        us, floor = data["step_us"][variant], data["floor_us"][weights]
        lines.append(f"| {variant} | {us:,.1f} | {data['weight_bytes'][weights] / 1e9:.3f} GB | {floor:,.1f} | {100 * floor / us:.0f}% |")
    labels = [f"{scheme}{'' if form == 'plain' else '_' + form}" for form in FORMS for scheme in ("int8", "int4")
              if not (form == "mma" and scheme == "int8")]
    lines += ["", "| projection | " + " | ".join(f"fastest {label.replace('_', ' ')} launch" for label in labels) + " |",
              "|---|" + "---|" * len(labels)]
    for row in data["rows"]:
        if "best" in row:
            best = row["best"]
            lines.append(f"| {row['shape'].replace('|', chr(92) + '|')} | "
                         + " | ".join(best.get(label) or "-" for label in labels) + " |")
    lines += ["", "A bf16 step at or above 100% of the floor means the copy rate read here is below what the card's "
              "weight reads reach: compare the variants with each other first."]
    lines += ["", "Command: `python scripts/bench_quantized_gemv.py --out quantized_gemv.json` (in `scripts/gpu_quantized.sh kernels OUT`)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="measure on the GPU and write the JSON here (report.md beside it)")
    parser.add_argument("--report", help="only render report.md beside this recorded JSON")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        with open(Path(args.report).with_name("report.md"), "w") as f:
            f.write(report(data))
        return
    if not args.out:
        parser.error("give --out (measure) or --report (render a recorded run)")
    started = time.time()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name, (n, k, norm, gated, residual, copies) in SHAPES.items():
        n_out = n // 2 if gated else n
        x = torch.randn(1, 1, k, device="cuda", dtype=DT)
        nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(DT) if norm else None
        res = torch.randn(1, 1, n_out, device="cuda", dtype=DT) if residual else None
        ws = [torch.randn(n, k, device="cuda", dtype=DT) / k**0.5 for _ in range(copies)]
        row = {"shape": name, "n": n, "k": k, "copies": copies, "us": {}, "bytes": {}}
        row["bytes"]["bf16"] = n * k * 2
        row["us"]["cublas_bf16"] = replay_us(lambda: [torch.nn.functional.linear(x, w) for w in ws], copies)
        if tg.gemv_applies((1, 1, k), (n, k), gated=gated) or (not gated and tg.gemv_applies((1, 1, k), (n, k))):
            row["us"]["gemv_bf16"] = replay_us(lambda: [tg.gemv_launch(x, w, nw, 1e-5, res, gated, True) for w in ws], copies)
        for scheme, group in (("int8", None), ("int4", GROUP)):
            stored = [quantize(w, scheme, group) for w in ws]
            q0 = stored[0]
            row["bytes"][scheme] = sum(t.numel() * t.element_size() for t in q0.tensors().values())

            def run(config=None, stored=stored, group=group):
                for s in stored:
                    tg.gemv_launch(x, s.qweight, nw, 1e-5, res, gated, True, config, scales=s.scales, zeros=s.zeros,
                                   group_size=group or 0)

            row["us"][f"gemv_{scheme}"] = replay_us(run, copies)
            row["us"][f"gemv_{scheme}_pervalue"] = replay_us(lambda: run(tg._config(k, gated, 4 if group else 8, n) | {"dequant": "value"}), copies)
            sweep = {f"gemv_{scheme}_{form}_{bn}x{bk}w{warps}": {"kernel": "rows", "BLOCK_N": bn, "BLOCK_K": bk,
                                                                   "num_warps": warps, "dequant": form}
                     for form in ("group", "bits") for bn, bk, warps in CONFIGS
                     if not (form == "bits" and scheme == "int4" and bk < GROUP)}
            sweep |= {f"gemv_{scheme}_bitsx_{bn}x{bk}w{warps}": {"kernel": "rows", "BLOCK_N": bn, "BLOCK_K": bk,
                                                               "num_warps": warps, "dequant": "bits", "x": "split"}
                      for bn, bk, warps in SPLIT_CONFIGS}
            if scheme == "int4":
                sweep |= {f"gemv_int4_groupx_{bn}x{bk}w{warps}": {"kernel": "rows", "BLOCK_N": bn, "BLOCK_K": bk,
                                                                "num_warps": warps, "dequant": "group", "x": "split"}
                          for bn, bk, warps in SPLIT_CONFIGS}
                sweep |= {f"gemv_int4_mma_{bn}x{bk}w{warps}s{stages}": {
                    "kernel": "mma", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
                    for bn, bk, warps, stages in MMA_CONFIGS}
            if k <= TILES_MAX_K:
                for form, extra in (("tiles", {}), ("tilesbits", {"dequant": "bits"}),
                                    ("tilesbitsx", {"dequant": "bits", "x": "split"})):
                    sweep |= {f"gemv_{scheme}_{form}_{bn}r{per_sm}p{warps}w{stages}s": {
                        "kernel": "tiles", "BLOCK_N": bn, "per_sm": per_sm, "num_warps": warps, "num_stages": stages,
                        **extra} for bn, per_sm, warps, stages in TILE_CONFIGS}
            for key, config in sweep.items():
                try:
                    row["us"][key] = replay_us(lambda: run(config), copies)
                except Exception as exc:  # noqa: BLE001 - a configuration may not compile; say so
                    print(f"  {name} {scheme} {config}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            if scheme == "int4" and not gated:
                try:
                    packed = []
                    for s in stored:
                        weight = torch.ops.aten._convert_weight_to_int4pack(s.qweight.contiguous(), 8)
                        sz = torch.stack([s.scales.t(), s.zeros.t()], dim=-1).contiguous()
                        packed.append((weight, sz))
                    x2 = x.reshape(1, k)
                    row["us"]["tinygemm_int4"] = replay_us(
                        lambda: [torch.ops.aten._weight_int4pack_mm(x2, wp, GROUP, sz) for wp, sz in packed], copies)
                except Exception as exc:  # noqa: BLE001
                    print(f"  tinygemm {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            del stored
        best = {}
        for scheme in ("int8", "int4"):
            for form in FORMS:
                key = _best_of(row["us"], scheme, form)
                label = scheme if form == "plain" else f"{scheme}_{form}"
                best[label] = key
                if key is not None:
                    row["us"][f"gemv_{label}_best"] = row["us"][key]
        row["best"] = best
        rows.append(row)
        print(name, {key: round(us, 2) for key, us in row["us"].items()}, flush=True)
        del ws
        torch.cuda.empty_cache()
    step = {}
    for variant in VARIANTS:
        if variant.endswith(("_bits_best", "_split_best", "_mma_best")) and not all(variant in row["us"] for row in rows):
            continue  # no such launch ran for some projection: no step to sum
        total = 0.0
        for row in rows:
            us = row["us"].get(variant) or row["us"].get("gemv_bf16" if variant == "gemv_bf16" else "cublas_bf16")
            if variant == "tinygemm_int4" and "tinygemm_int4" not in row["us"]:
                us = row["us"]["gemv_int4"]  # the gated projection: tinygemm has no fold, take ours
            if variant == "gemv_bf16" and "gemv_bf16" not in row["us"]:
                us = row["us"]["cublas_bf16"]  # the bf16 lm_head is cuBLAS's in the float step
            total += us * (1 if row["shape"].startswith("lm_head") else LAYERS)
        step[variant] = total
    weights = {s: sum(r["bytes"][s] * (1 if r["shape"].startswith("lm_head") else LAYERS) for r in rows) for s in ("bf16", "int8", "int4")}
    floor = {s: b / rate * 1e6 for s, b in weights.items()}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": rate,
           "rows": rows, "step_us": step, "weight_bytes": weights, "floor_us": floor, "seconds": time.time() - started}
    print("step (16 layers + lm_head), us:", {key: round(v, 1) for key, v in step.items()})
    print("floor us:", {key: round(v, 1) for key, v in floor.items()})
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    with open(Path(args.out).with_name("report.md"), "w") as f:
        f.write(report(out))


if __name__ == "__main__":
    main()
