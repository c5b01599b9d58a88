"""Bulk L2 prefetch in the decode kernels, measured on and off in one run.

Two questions, both timed as a step runs them (16 layers' own weights and K/V captured in one CUDA
graph, median replay; Llama-3.2-1B shape, bf16, batch 1):

1. *Own* prefetch: a kernel requests the bytes it is about to read with one instruction per
   thread (``triton_base.prefetch_l2``) before its loads: the one-token attention its split's K/V
   rows, the per-row-block GEMV its weight rows, the persistent GEMV the tiles ``ahead`` of the one
   it works on.
2. *Next* prefetch: a kernel requests (a prefix of) the next kernel's weight, so the next kernel's
   ramp reads from L2. Measured on a chain of one decode layer's kernels, 16 times: q|k|v GEMV
   (+norm), attention, output GEMV (+residual), gate|up GEMV (+norm, SiLU*mul), down GEMV
   (+residual).

Every variant is timed in rounds (A B C ... A B C ...), so the spread of one variant across rounds
shows the noise.

    python scripts/bench_prefetch.py --out prefetch.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench_attention import time_ms  # scripts/, the script's own folder

from offgraph_export.lowering import triton_attend as ta
from offgraph_export.lowering import triton_gemv as tg

LAYERS = 16
DT = torch.bfloat16
HQ, HKV, D, HIDDEN, FFN = 32, 8, 64, 2048, 8192
ROWS = 32768
HISTORIES = (1024, 8192, 16384)


def per_layer_us(fn) -> float:
    return 1e3 * time_ms(fn, 30) / LAYERS


def rounds(variants: dict, n: int, log) -> dict:
    """Time every variant ``n`` times, interleaved; returns name -> {median, all}."""
    times = {name: [] for name in variants}
    for _ in range(n):
        for name, fn in variants.items():
            times[name].append(per_layer_us(fn))
    out = {name: {"median_us": statistics.median(t), "all_us": t} for name, t in times.items()}
    for name, r in out.items():
        log(f"  {name:40s} {r['median_us']:8.2f} us  ({', '.join(f'{t:.2f}' for t in r['all_us'])})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    dev = "cuda"
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    # --- weights and storage of 16 layers -------------------------------------------------------
    def w(n, k):
        return [torch.randn(n, k, device=dev, dtype=DT) / k**0.5 for _ in range(LAYERS)]

    w_qkv, w_o, w_gu, w_down = w(3072, HIDDEN), w(HIDDEN, HIDDEN), w(2 * FFN, HIDDEN), w(HIDDEN, FFN)
    norm = torch.randn(HIDDEN, device=dev, dtype=DT)
    res = torch.randn(HIDDEN, device=dev, dtype=DT)
    x = torch.randn(1, 1, HIDDEN, device=dev, dtype=DT)
    xf = torch.randn(1, 1, FFN, device=dev, dtype=DT)
    stores = [(torch.randn(1, HKV, ROWS, D, device=dev, dtype=DT), torch.randn(1, HKV, ROWS, D, device=dev, dtype=DT))
              for _ in range(LAYERS)]
    q = torch.randn(1, HQ, 1, D, device=dev, dtype=DT)
    k = torch.randn(1, HKV, 1, D, device=dev, dtype=DT)
    v = torch.randn(1, HKV, 1, D, device=dev, dtype=DT)
    angle = torch.rand(D, device=dev)
    rope = (angle.cos().to(DT), angle.sin().to(DT))
    common = dict(GROUP=HQ // HKV, HEAD_DIM=D, V_DIM=D, BLOCK_D=D, BLOCK_DV=D, BLOCK_N=64,
                  HAS_WINDOW=False, QK_FP32=False, PV_FP32=False)
    positions = {h: torch.tensor([h], device=dev, dtype=torch.int64) for h in HISTORIES}
    out = torch.empty(1, HQ, 1, D, device=dev, dtype=DT)

    def attend(layer, history, config):
        ks, vs = stores[layer]
        ta._decode_step(q, k, v, positions[history], ks, vs, None, 0.125, DT, out, common, rope, config)

    # --- 0. a prefetch is a hint: results must not change by a bit --------------------------------
    same = {}
    for history in HISTORIES:
        outs = []
        for c in ({}, {"prefetch": True, "pieces": 32, "next": w_o[0]}):
            ks, vs = stores[0][0].clone(), stores[0][1].clone()
            ta._decode_step(q, k, v, positions[history], ks, vs, None, 0.125, DT, out, common, rope, c)
            outs.append((out.clone(), ks, vs))
        same[f"attention {history}"] = all(torch.equal(a, b) for a, b in zip(*outs))
    for name, (wl, xi, nw, gated, r) in {"qkv": (w_qkv[0], x, norm, False, None),
                                         "gate|up": (w_gu[0], x, norm, True, None),
                                         "down": (w_down[0], xf, None, False, res)}.items():
        base = tg._config(wl.shape[1], gated)
        on = {**base, "prefetch": True, "ahead": 2, "next": w_o[1]}
        same[name] = torch.equal(tg.gemv_launch(xi, wl, nw, 1e-5, r, gated, True, base),
                                 tg.gemv_launch(xi, wl, nw, 1e-5, r, gated, True, on))
    torch.cuda.synchronize()
    result["bit_equal_with_prefetch"] = same
    log(f"results with prefetch equal to without: {same}")

    # --- 1a. attention alone --------------------------------------------------------------------
    result["attention"] = {}
    for history in HISTORIES:
        log(f"attention alone, {history} history (us per layer)")
        variants = {"off": {}, "own, 1 piece": {"prefetch": True, "pieces": 1},
                    "own, 4 pieces": {"prefetch": True, "pieces": 4},
                    "own, 32 pieces": {"prefetch": True, "pieces": 32},
                    "own, 128 pieces": {"prefetch": True, "pieces": 128}}
        result["attention"][history] = rounds(
            {name: (lambda c=c, h=history: [attend(i, h, c) for i in range(LAYERS)]) for name, c in variants.items()},
            args.rounds, log)
        save()

    # --- 1b. GEMVs alone ------------------------------------------------------------------------
    shapes = {  # name: (weights, x, norm, gated, residual)
        "q|k|v+norm": (w_qkv, x, norm, False, None),
        "o+residual": (w_o, x, None, False, res),
        "gate|up+norm+silu*mul": (w_gu, x, norm, True, None),
        "down+residual": (w_down, xf, None, False, res),
    }
    result["gemv"] = {}
    for name, (ws, xi, nw, gated, r) in shapes.items():
        base = tg._config(ws[0].shape[1], gated)
        if base["kernel"] == "tiles":
            variants = {f"ahead {a}": {**base, "ahead": a} for a in (0, 1, 2, 4)}
        else:
            variants = {"off": base, "own rows": {**base, "prefetch": True}}
        log(f"{name} alone (us per layer), {base}")
        result["gemv"][name] = rounds(
            {vn: (lambda c=c, ws=ws, xi=xi, nw=nw, gated=gated, r=r:
                  [tg.gemv_launch(xi, wl, nw, 1e-5, r, gated, True, c) for wl in ws]) for vn, c in variants.items()},
            args.rounds, log)
        save()

    # --- 2. one layer's chain, 16 times ---------------------------------------------------------
    def chain(history, own: bool, nxt: set, down_cap_mb: int = 8):
        """``nxt``: which kernels prefetch the next one's weight: "attn" (-> o), "down" (-> next
        layer's q|k|v), "gu" (-> a prefix of down), "o" (-> a prefix of gate|up's gate and up rows
        is not one range: left out), "qkv" (-> nothing useful: the attention reads K/V)."""
        cfg_qkv = {**tg._config(HIDDEN), **({"prefetch": True} if own else {})}
        cfg_o = dict(cfg_qkv)
        cfg_down = {**tg._config(FFN), **({"prefetch": True} if own else {})}
        cfg_gu = {**tg._config(HIDDEN, True), **({"ahead": 2} if own else {})}
        att = {"prefetch": True} if own else {}
        cap = down_cap_mb * (1 << 20) // 2

        def run():
            for i in range(LAYERS):
                nxt_qkv = w_qkv[(i + 1) % LAYERS]
                tg.gemv_launch(x, w_qkv[i], norm, 1e-5, None, False, True, cfg_qkv)
                ks, vs = stores[i]
                ta._decode_step(q, k, v, positions[history], ks, vs, None, 0.125, DT, out, common, rope,
                                {**att, **({"next": w_o[i]} if "attn" in nxt else {})})
                tg.gemv_launch(x, w_o[i], None, 1e-5, res, False, True, cfg_o)
                tg.gemv_launch(x, w_gu[i], norm, 1e-5, None, True, True,
                               {**cfg_gu, **({"next": w_down[i].view(-1)[:cap]} if "gu" in nxt else {})})
                tg.gemv_launch(xf, w_down[i], None, 1e-5, res, False, True,
                               {**cfg_down, **({"next": nxt_qkv} if "down" in nxt else {})})
        return run

    result["chain"] = {}
    for history in (1024, 16384):
        log(f"one decode layer's kernels x16, {history} history (us per layer)")
        variants = {
            "none": chain(history, False, set()),
            "own": chain(history, True, set()),
            "next attn->o": chain(history, False, {"attn"}),
            "next attn->o, down->qkv": chain(history, False, {"attn", "down"}),
            "next attn->o, down->qkv, gu->down 8MB": chain(history, False, {"attn", "down", "gu"}),
            "next attn->o, down->qkv, gu->down 16MB": chain(history, False, {"attn", "down", "gu"}, 16),
            "own + next attn->o, down->qkv": chain(history, True, {"attn", "down"}),
        }
        result["chain"][history] = rounds(variants, args.rounds, log)
        save()
    log("done")


if __name__ == "__main__":
    main()
