"""Sweep launch configurations of the decode method's own kernels, timed as a decode step runs them.

Each measurement is 16 calls, one per layer of a Llama-3.2-1B-shaped model (bf16, batch 1), each on
its own weights or its own K/V storage, captured in one CUDA graph and replayed: the median replay
time over the 16 calls is one call's time, with the launch gaps and cold caches a real step has
(16 layers of weights or K/V do not fit in L2). Kernels are called through the same host code the
compiled step uses (``triton_gemv.gemv_launch``, ``attend_decode.decode_step``), with a launch
``config`` overriding the built-in choice.

* GEMV (``kernels/triton_gemv.py``): the four projections with their folds, both kernels (one
  program per row block over ``BLOCK_N, BLOCK_K, num_warps``; persistent row tiles over
  ``BLOCK_N, per_sm, num_warps, num_stages``); beside cuBLAS's ``F.linear`` of the same weights
  (no folds).
* One-token attention (``kernels/attend_decode.py``, rotary fold on): over ``num_warps``,
  ``num_stages``, ``BLOCK_N`` at 1k and 16k history, then split count and minimum keys per split
  for the best few, at 1k, 8k and 16k.

    python scripts/sweep_decode_kernels.py --out sweep.json [--only gemv|attention]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch

from bench_attention import time_ms  # scripts/, the script's own folder

from offgraph_export.kernels import attend_common, attend_decode
from offgraph_export.kernels import triton_gemv as tg

LAYERS = 16
DT = torch.bfloat16
SHAPE_SETS = {  # model shape: {name: (weight rows N, K, norm, gated, residual)}
    "llama-1b": {
        "qkv+norm": (3072, 2048, True, False, False),
        "o+residual": (2048, 2048, False, False, True),
        "gate|up+norm+silu*mul": (16384, 2048, True, True, False),
        "down+residual": (2048, 8192, False, False, True),
    },
    "llama-8b": {  # benchmarks/configs/llama-3.1-8b
        "qkv+norm": (6144, 4096, True, False, False),
        "o+residual": (4096, 4096, False, False, True),
        "gate|up+norm+silu*mul": (28672, 4096, True, True, False),
        "down+residual": (4096, 14336, False, False, True),
    },
    "qwen-7b": {  # benchmarks/configs/qwen2.5-7b (the sweep leaves the q|k|v bias out)
        "qkv+norm": (4608, 3584, True, False, False),
        "o+residual": (3584, 3584, False, False, True),
        "gate|up+norm+silu*mul": (37888, 3584, True, True, False),
        "down+residual": (3584, 18944, False, False, True),
    },
}
GEMV_BLOCKS = [(1, 1024), (1, 2048), (2, 512), (2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048),
               (8, 256), (8, 512), (8, 1024)]
HQ, HKV, D = 32, 8, 64
ROWS = 32768


def graph_us(fn, reps: int = 30) -> float:
    """Median time of one replay of ``fn`` captured as a CUDA graph, divided by LAYERS, in us."""
    return 1e3 * time_ms(fn, reps) / LAYERS


def sweep_gemv(log, shapes: dict, only: str | None = None) -> list[dict]:
    rows = []
    for name, (n, k, norm, gated, residual) in shapes.items():
        if only and only not in name:
            continue
        n_out = n // 2 if gated else n
        x = torch.randn(1, 1, k, device="cuda", dtype=DT)
        ws = [torch.randn(n, k, device="cuda", dtype=DT) / k**0.5 for _ in range(LAYERS)]
        nw = torch.randn(k, device="cuda", dtype=DT) if norm else None
        res = torch.randn(n_out, device="cuda", dtype=DT) if residual else None
        gb = n * k * 2 / 1e9

        def run(config, ws=ws, x=x, nw=nw, res=res, gated=gated):
            for w in ws:
                tg.gemv_launch(x, w, nw, 1e-5, res, gated, True, config)

        cublas = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws])
        default = tg._config(k, gated)
        configs = [{"kernel": "rows", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
                   for (bn, bk), warps in itertools.product(GEMV_BLOCKS, (4, 8)) if bk <= k]
        configs += [{"kernel": "tiles", "BLOCK_N": bn, "per_sm": per_sm, "num_warps": warps, "num_stages": stages}
                    for bn, per_sm, warps, stages in itertools.product((1, 2, 4, 8), (1, 2, 4), (4, 8), (2, 3, 4))
                    if bn * k <= 16384]
        results = []
        for config in configs:
            try:
                us = graph_us(lambda: run(config))
            except Exception as exc:  # noqa: BLE001 - a config may not compile; record it
                log(f"{name} {config}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.append({"config": config, "us": us, "tb_s": gb / us * 1e3})
        results.sort(key=lambda r: r["us"])
        base = next((r for r in results if r["config"] == default), None)
        row = {"shape": name, "n": n, "k": k, "gb": gb, "cublas_us": cublas, "default": default,
               "default_us": base["us"] if base else None, "best": results[:5]}
        rows.append(row)
        log(f"{name:24s} default {default} {row['default_us']:.2f} us; best {results[0]['config']} "
            f"{results[0]['us']:.2f} us ({results[0]['tb_s']:.2f} TB/s); cuBLAS linear {cublas:.2f} us")
        for r in results[1:5]:
            log(f"{'':24s} next {r['config']} {r['us']:.2f} us ({r['tb_s']:.2f} TB/s)")
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_attention(log) -> dict:
    q = torch.randn(1, HQ, 1, D, device="cuda", dtype=DT)
    k = torch.randn(1, HKV, 1, D, device="cuda", dtype=DT)
    v = torch.randn(1, HKV, 1, D, device="cuda", dtype=DT)
    stores = [(torch.randn(1, HKV, ROWS, D, device="cuda", dtype=DT),
               torch.randn(1, HKV, ROWS, D, device="cuda", dtype=DT)) for _ in range(LAYERS)]
    angle = torch.rand(D, device="cuda")
    rope = (angle.cos().to(DT), angle.sin().to(DT))
    launch = attend_common.AttendLaunch.for_step(q, k, v, *stores[0], None, 0.125)
    positions = {h: torch.tensor([h], device="cuda", dtype=torch.int64) for h in (1024, 8192, 16384)}

    def timed(config, history):
        pos = positions[history]
        out = torch.empty(1, HQ, 1, D, device="cuda", dtype=DT)

        def run():
            for ks, vs in stores:
                attend_decode.decode_step(q, k, v, pos, ks, vs, out, launch, rope, config)
        us = graph_us(run)
        return {"us": us, "tb_s": history * HKV * D * 2 * 2 / us * 1e-6}

    default = {"splits": attend_decode._decode_splits(1, HKV, q.device),
               "min_split_keys": attend_decode._DECODE_MIN_SPLIT_KEYS, "BLOCK_N": launch.block_n}
    result = {"default": {**default, **{h: timed({}, h) for h in positions}}, "stage1": [], "stage2": []}
    log(f"attention default {default}: " + ", ".join(f"{h}: {result['default'][h]['us']:.2f} us "
                                                      f"({result['default'][h]['tb_s']:.2f} TB/s)" for h in positions))
    for warps, stages, block_n in itertools.product((2, 4, 8), (2, 3, 4), (32, 64, 128)):
        config = {"num_warps": warps, "num_stages": stages, "BLOCK_N": block_n}
        try:
            row = {"config": config, **{str(h): timed(config, h) for h in (1024, 16384)}}
        except Exception as exc:  # noqa: BLE001
            log(f"attention {config}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        result["stage1"].append(row)
    result["stage1"].sort(key=lambda r: r["16384"]["us"] + r["1024"]["us"])
    for row in result["stage1"][:6]:
        log(f"  {row['config']}: 1k {row['1024']['us']:.2f} us, 16k {row['16384']['us']:.2f} us ({row['16384']['tb_s']:.2f} TB/s)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for row in result["stage1"][:3]:
        for per_sm, min_keys in itertools.product((1, 2, 4), (64, 128, 256)):
            splits = min(attend_common._MAX_SPLITS, math.ceil(per_sm * sms / HKV))
            config = {**row["config"], "splits": splits, "min_split_keys": min_keys}
            result["stage2"].append({"config": config, **{str(h): timed(config, h) for h in positions}})
    result["stage2"].sort(key=lambda r: r["16384"]["us"] + r["1024"]["us"])
    # the built-in choice again, last: its spread against the first reading is the sweep's noise
    result["default_again"] = {h: timed({}, h) for h in positions}
    log("attention default again: " + ", ".join(f"{h}: {result['default_again'][h]['us']:.2f} us" for h in positions))
    for row in result["stage2"][:6]:
        log(f"  {row['config']}: " + ", ".join(f"{h} {row[h]['us']:.2f} us ({row[h]['tb_s']:.2f} TB/s)" for h in ("1024", "8192", "16384")))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=("gemv", "attention"))
    parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="llama-1b", help="the GEMV shapes: which model's projections")
    parser.add_argument("--projection", help="GEMV: only the projections whose name contains this (e.g. gate)")
    args = parser.parse_args()
    torch.manual_seed(0)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    if args.only != "attention":
        result["gemv"] = sweep_gemv(log, SHAPE_SETS[args.shapes], args.projection)
        save()
    if args.only != "gemv":
        result["attention"] = sweep_attention(log)
        save()


if __name__ == "__main__":
    main()
