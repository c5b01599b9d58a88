"""Aggregate decode throughput of a batched artifact against the single-session artifact stepping
the same sessions in turn, at B concurrent sessions (both replayed as CUDA graphs), with the memory
floor (weights + every session's live K/V at the copy rate measured in the same run). A quick
measurement for one device call; ``benchmarks/`` holds the full benchmark.

    python scripts/measure_batched.py --batched B.pt2 --single S.pt2 --config DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def copy_rate() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del x, y
    return 2 * 2 * 1024**3 / (statistics.median(times) * 1e-3)  # read + write bytes / s


def timed(fn, n, warmup=3):
    out = []
    for i in range(n + warmup):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= warmup:
            out.append(s.elapsed_time(e))
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batched", required=True)
    p.add_argument("--single")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    from offgraph_export.frontends import load_bundle
    from offgraph_export.runtime import Session, load_artifact
    from offgraph_export.runtime.batched import BatchedRunner

    out = Path(args.out)
    rate = copy_rate()
    log(f"copy rate {rate / 1e12:.2f} TB/s")
    rows = []
    batched = load_artifact(args.batched, single_threaded=True)
    weights = sum(t.numel() * t.element_size() for t in _weights(batched))
    log(f"weights {weights / 1e9:.2f} GB")
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    hist = args.history
    runner = BatchedRunner(batched, cuda_graphs=True)
    budget = runner.manifest.max_write
    for b in args.batches:
        sids = [runner.open() for _ in range(b)]
        prompts = {sid: torch.randint(0, vocab, (hist,), generator=gen).tolist() for sid in sids}
        t0 = time.perf_counter()
        fed = {sid: 0 for sid in sids}
        while any(fed[s] < hist for s in sids):  # packed prefill, several sessions a step
            feeds, room = {}, budget
            for s in sids:
                if fed[s] < hist and room:
                    n = min(room, hist - fed[s])
                    feeds[s] = prompts[s][fed[s] : fed[s] + n]
                    fed[s] += n
                    room -= n
            runner.step(feeds)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        token = {s: [7] for s in sids}
        ms = timed(lambda: runner.step(token), args.steps)
        m = runner.metrics()
        floor_ms = (weights + m.live_bytes) / rate * 1e3
        rows.append({"contender": "batched", "B": b, "history": hist, "ms_per_step": ms, "tokens_per_s": b * 1e3 / ms,
                     "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms, "kv_allocated": m.allocated_bytes,
                     "kv_live": m.live_bytes, "prefill_s": prefill_s})
        log(json.dumps(rows[-1]))
        if b == 16:
            rows[-1]["breakdown"] = _profile(lambda: runner.step(token))
        for s in sids:
            runner.close(s)
    del runner
    torch.cuda.empty_cache()
    if args.single:
        single = load_artifact(args.single, single_threaded=True)
        bundle = load_bundle(f"hf:{args.config}", dtype="bfloat16")
        make_inputs = bundle.make_inputs
        for b in args.batches:
            sessions = []
            for _ in range(b):
                s = Session(single, cuda_graphs=True)
                s.reserve(hist + args.steps + 8)
                ids = torch.randint(0, vocab, (1, hist), generator=gen).cuda()
                for start in range(0, hist, single.specs.manifest.max_write):
                    s.feed(make_inputs, ids[:, start : start + single.specs.manifest.max_write])
                sessions.append(s)
            tok = torch.full((1, 1), 7, dtype=torch.int64, device="cuda")
            inputs = make_inputs(tok, 0)

            def in_turn():
                for s in sessions:
                    s.feed(lambda _t, _s: inputs, tok)
            ms = timed(in_turn, max(3, args.steps // max(1, b // 4)))
            live = sum(s.metrics().committed_length for s in sessions) * _row_bytes(single)
            floor_ms = (weights * b + live) / rate * 1e3  # in turn: the weights are read once per session
            rows.append({"contender": "single-in-turn", "B": b, "history": hist, "ms_per_step": ms, "tokens_per_s": b * 1e3 / ms,
                         "floor_ms": floor_ms, "pct_of_floor": 100 * floor_ms / ms,
                         "kv_allocated": sum(s.metrics().allocated_bytes for s in sessions), "kv_live": live})
            log(json.dumps(rows[-1]))
            for s in sessions:
                s.close()
            torch.cuda.empty_cache()
    (out / "batched_rows.json").write_text(json.dumps(rows, indent=2))
    lines = ["| contender | B | history | ms/step | tokens/s | % of floor | KV allocated / live MB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['contender']} | {r['B']} | {r['history']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['pct_of_floor']:.0f}% | {r['kv_allocated'] / 1e6:.0f} / {r['kv_live'] / 1e6:.0f} |")
    lines.append(f"\ncopy rate {rate / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB")
    (out / "batched_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _weights(artifact):
    """The package's weight bytes (stored once, read once per step)."""
    return _by_file(artifact)


def _by_file(artifact):
    import zipfile

    with zipfile.ZipFile(artifact.path) as z:
        total = sum(i.file_size for i in z.infolist() if "/data/weights/" in i.filename)
    return [torch.empty(total, dtype=torch.uint8, device="meta")]


def _row_bytes(artifact) -> int:
    m = artifact.specs.manifest
    return sum(2 * l.kv_heads * l.head_dim * torch.finfo(getattr(torch, m.storage_dtype)).bits // 8 for l in m.layers)


def _profile(step) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    by = {}
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.device_time_total > 0:
            by[evt.key[:60]] = by.get(evt.key[:60], 0) + evt.device_time_total / 5
    return dict(sorted(by.items(), key=lambda kv: -kv[1])[:15])


if __name__ == "__main__":
    main()
