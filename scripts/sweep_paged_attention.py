"""Sweep the batched step's paged attention launch settings at the benchmark's shapes, timed as a
step runs them: 16 calls (one per layer of a Llama-3.2-1B-shaped model: 32 query heads, 8 kv heads
of 64, bf16, pages of 16 rows), each over its own page pools, captured in one CUDA graph and
replayed; the median replay over 16 is one call's time (16 layers of K/V do not fit in L2, so
the caches are as cold as in a step). Each call writes its tokens' rows and attends, through the
op's own host code (``paged_attend.paged_step``) with the ``PagedLaunch`` settings under test.

Cases: B sessions of one decode token each at ``history`` positions, every session's pages a
random permutation of the pool (a pool shared by sessions that grew together), capacity = the
benchmark's (history + a decode budget, or ``--capacity``). Beside it, for B = 1, the
single-session one-token step (``triton_update_and_attend``) over flat storage of the same
capacity.

    python scripts/sweep_paged_attention.py --out sweep.json [--batches 1 4 16 64] [--history 1024 8192]
        [--page-sizes 16 64] [--default-only] [--fold]

``--page-sizes``: the pools' page rows (each case at each; 16, the benchmark's, by default): pages of
at least the key block (64) take the one-table-entry-per-block path. ``--default-only``: time the
default settings only (a quick comparison of page sizes). ``--fold``: also time each case through
the one-row-per-session path (``paged_step(one_row_per_session=True)``: no write kernel, no q/k/v
copies, one rotary row per token rotated in the kernel), a decode step's form.

Prints and writes, per case, the default settings' time and the best few, in us per layer-call and
TB/s of K/V read.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import time_ms  # noqa: E402  (scripts/, the script's own folder)

from offgraph_export.kernels import paged_attend  # noqa: E402
from offgraph_export.kernels.triton_attend import triton_update_and_attend  # noqa: E402

LAYERS = 16
HQ, HKV, D = 32, 8, 64
DT = torch.bfloat16


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


class Layers:
    """16 layers' pools and one step's inputs for ``batch`` sessions at ``history``."""

    def __init__(self, batch: int, history: int, capacity: int, gen: torch.Generator, page: int) -> None:
        PAGE = page
        pages_per_session = -(-capacity // PAGE)
        pool = batch * pages_per_session + 1  # page 0: the scratch page
        self.k = [torch.randn(pool, PAGE, HKV, D, dtype=DT, device="cuda") for _ in range(LAYERS)]
        self.v = [torch.randn(pool, PAGE, HKV, D, dtype=DT, device="cuda") for _ in range(LAYERS)]
        perm = torch.randperm(pool - 1, generator=gen)[: batch * pages_per_session] + 1
        table = torch.zeros(batch + 1, pages_per_session, dtype=torch.int32)
        table[1:] = perm.view(batch, pages_per_session).to(torch.int32)
        pos = torch.full((batch,), history, dtype=torch.int64)
        slots = torch.arange(1, batch + 1, dtype=torch.int32)
        rows = table[slots.long(), history // PAGE] * PAGE + history % PAGE
        lengths = torch.zeros(batch + 1, dtype=torch.int32)
        lengths[1:] = history + 1
        cuda = lambda x: x.to("cuda")  # noqa: E731
        self.batch = (cuda(slots), cuda(rows.to(torch.int32)), cuda(table), cuda(lengths))
        self.pos = cuda(pos)
        self.q = torch.randn(1, HQ, batch, D, dtype=DT, device="cuda")
        self.kv = torch.randn(1, HKV, batch, D, dtype=DT, device="cuda")
        self.bytes = 2 * batch * (history + 1) * HKV * D * 2  # K and V rows read per call

    def step(self, settings: paged_attend.PagedLaunch):
        def run():
            for k, v in zip(self.k, self.v):
                paged_attend.paged_step(self.q, self.kv, self.kv, self.pos, k, v, *self.batch, None,
                                        D**-0.5, DT, settings)
        return run

    def folded(self, settings: paged_attend.PagedLaunch):
        """The same step through the one-row-per-session path (every token its session's only new
        row): writes folded into the attention kernel, q/k/v read in place, one rotary row per
        token rotated in the kernel (the real step's rotary and copy kernels are gone with it)."""
        cos = torch.rand(1, self.q.shape[2], D, dtype=DT, device="cuda")
        sin = torch.rand(1, self.q.shape[2], D, dtype=DT, device="cuda")

        def run():
            for k, v in zip(self.k, self.v):
                paged_attend.paged_step(self.q, self.kv, self.kv, self.pos, k, v, *self.batch, None,
                                        D**-0.5, DT, settings, rope_cos=cos, rope_sin=sin, one_row_per_session=True)
        return run


def single_session(history: int, capacity: int) -> float:
    ks = [torch.randn(1, HKV, capacity, D, dtype=DT, device="cuda") for _ in range(LAYERS)]
    vs = [torch.randn(1, HKV, capacity, D, dtype=DT, device="cuda") for _ in range(LAYERS)]
    q = torch.randn(1, HQ, 1, D, dtype=DT, device="cuda")
    kv = torch.randn(1, HKV, 1, D, dtype=DT, device="cuda")
    pos = torch.tensor([history], device="cuda")

    def run():
        for k, v in zip(ks, vs):
            triton_update_and_attend(q, kv, kv, pos, k, v, None, D**-0.5, DT)
    return time_ms(run, 50) * 1e3 / LAYERS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--history", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--capacity", type=int, help="rows per session (default: history + 300, rounded up to 64)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping past this many seconds")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16], help="page rows of the pools (each case at each)")
    p.add_argument("--default-only", action="store_true", help="time the default settings only")
    p.add_argument("--fold", action="store_true", help="also time the one-row-per-session path (fold_us) with the default settings")
    args = p.parse_args()
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    default = paged_attend.default_launch()
    grid = [
        dataclasses.replace(default, programs_per_sm=ps, num_warps=w, num_stages=st, num_stages_small_heads=st,
                            max_block_n=bn, min_split_keys=mk)
        for ps, w, st, bn, mk in itertools.product((4, 8, 16), (2, 4), (2, 3, 4), (32, 64), (64, 128, 256))
    ]
    if args.default_only:
        grid = []
    results = []
    out = Path(args.out)
    for history in args.history:
        capacity = args.capacity or -(-(history + 300) // 64) * 64
        single_us = single_session(history, capacity)
        log(f"single-session step at {history}: {single_us:.1f} us per layer")
        for batch, page in itertools.product(args.batches, args.page_sizes):
            layers = Layers(batch, history, capacity, gen, page)
            base_us = time_ms(layers.step(default), args.iters) * 1e3 / LAYERS
            fold_us = time_ms(layers.folded(default), args.iters) * 1e3 / LAYERS if args.fold else None
            if fold_us is not None:
                log(f"B={batch} h={history} pages of {page}: one row per session (folded writes, rotary in the kernel) "
                    f"{fold_us:.1f} us against {base_us:.1f} us ({layers.bytes / fold_us / 1e6:.2f} TB/s)")
            rows = []
            for settings in grid:
                if time.time() - t_start > args.budget_s:
                    break
                us = time_ms(layers.step(settings), args.iters) * 1e3 / LAYERS
                rows.append({"us": us, "TBps": layers.bytes / us / 1e6, **dataclasses.asdict(settings)})
            rows.sort(key=lambda r: r["us"])
            case = {"batch": batch, "history": history, "capacity": capacity, "page_size": page, "default_us": base_us,
                    "default_TBps": layers.bytes / base_us / 1e6, "fold_us": fold_us, "single_session_us": single_us if batch == 1 else None,
                    "best": rows[:8], "tried": len(rows), "all": rows}
            results.append(case)
            best = rows[0] if rows else None
            log(f"B={batch} h={history} pages of {page}: default {base_us:.1f} us ({case['default_TBps']:.2f} TB/s); "
                f"best {best and round(best['us'], 1)} us {best and {k: best[k] for k in ('programs_per_sm', 'num_warps', 'num_stages', 'max_block_n', 'min_split_keys')}}")
            out.write_text(json.dumps(results, indent=1))
            del layers
            torch.cuda.empty_cache()
    # the settings that are best over all cases (sum of time relative to each case's best)
    score: dict[str, float] = {}
    for case in results:
        top = case["all"][0]["us"] if case["all"] else 1.0
        for r in case["all"]:
            key = json.dumps({k: r[k] for k in ("programs_per_sm", "num_warps", "num_stages", "max_block_n", "min_split_keys")})
            score[key] = score.get(key, 0.0) + r["us"] / top
    ranked = sorted(score.items(), key=lambda kv: kv[1])[:10]
    log("over all cases (sum of time / the case's best; lower is better):")
    for key, s in ranked:
        log(f"  {s:.3f}  {key}")
    out.write_text(json.dumps({"cases": results, "overall": ranked}, indent=1))


if __name__ == "__main__":
    main()
