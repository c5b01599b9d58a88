"""Time the decode GEMV (lowering/triton_gemv.py) with its folds at the Llama-3.2-1B projection
shapes, over a sweep of launch configurations, beside cuBLAS's plain ``F.linear`` of the same
weight. L2 is flushed before every timed call (``triton.testing.do_bench``), as in a decode step
whose 2.5 GB of weights never fit in cache. Prints one table; ``--out`` writes the rows as JSON.

    python scripts/bench_gemv.py --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.testing

from offgraph_export.lowering import triton_gemv as tg

SHAPES = {  # name: (weight rows N, K, norm, gated, residual)
    "qkv+norm": (3072, 2048, True, False, False),
    "o+residual": (2048, 2048, False, False, True),
    "gate|up+norm+silu*mul": (16384, 2048, True, True, False),
    "down+residual": (2048, 8192, False, False, True),
}


def _median_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--block-n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (n, k, norm, gated, residual) in SHAPES.items():
        n_out = n // 2 if gated else n
        x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nw = torch.randn(k, device="cuda", dtype=torch.bfloat16) if norm else x.reshape(k)
        res = torch.randn(n_out, device="cuda", dtype=torch.bfloat16) if residual else None
        out = torch.empty(n_out, device="cuda", dtype=torch.bfloat16)
        gbytes = w.numel() * w.element_size() / 1e9
        cublas = _median_us(lambda: torch.nn.functional.linear(x, w))
        default = _median_us(lambda: tg.triton_gemv(x, w, nw if norm else None, 1e-5, res, gated))
        best = None
        for block_n, block_k, warps in itertools.product(args.block_n, args.block_k, args.warps):
            def run(block_n=block_n, block_k=block_k, warps=warps):
                tg._gemv_kernel[(triton.cdiv(n_out, block_n),)](
                    x, w, out, nw, res if res is not None else out, n_out, k, w.stride(0), 0,
                    n_out if gated else 0, 1e-5, NORM=norm, GATED=gated, RESIDUAL=residual,
                    BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                )
            try:
                us = _median_us(run)
            except Exception as exc:  # a config that does not compile (resources) is skipped
                print(f"{name} {block_n}x{block_k} w{warps}: {type(exc).__name__}")
                continue
            row = dict(shape=name, block_n=block_n, block_k=block_k, warps=warps, us=us, tb_s=gbytes / us * 1e3)
            rows.append(row)
            if best is None or us < best["us"]:
                best = row
        rows.append(dict(shape=name, config="default", us=default, tb_s=gbytes / default * 1e3))
        rows.append(dict(shape=name, config="cublas F.linear (no folds)", us=cublas, tb_s=gbytes / cublas * 1e3))
        print(f"{name:24s} N={n} K={k}: default {default:6.1f} us ({gbytes / default * 1e3:.2f} TB/s, "
              f"{'x'.join(map(str, tg._config(k)))} w4, through the op); best {best['us']:6.1f} us ({best['tb_s']:.2f} TB/s, "
              f"{best['block_n']}x{best['block_k']} w{best['warps']}); cuBLAS linear {cublas:6.1f} us "
              f"({gbytes / cublas * 1e3:.2f} TB/s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
