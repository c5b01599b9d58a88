"""Attention-step kernel time versus history length: the Triton step reads only valid rows, so
its time should follow the history, not the storage capacity; the portable aten step reads the
whole storage.

    python scripts/bench_attention.py [--capacity 32768] [--history 1024 16384] [--out FILE]

Shape: Llama-3.2-1B attention (32 query heads, 8 KV heads, head dim 64), batch 1, bf16 storage,
one decode token. Times are medians over ``--iters`` CUDA-graph replays of one call, each
bracketed by CUDA events. Each call also writes its token's row (position = history), as the
lowered step does.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.kernels.triton_attend import triton_update_and_attend


def captured(fn, keep_graph: bool = False):
    """``fn`` warmed up on a side stream (first launches may compile or allocate), then captured in
    a CUDA graph: ``(graph, fn's output)``. ``keep_graph``: the graph is kept for editing and
    instantiated by the caller (``torch.cuda.CUDAGraph(keep_graph=True)``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replayed_ms(graph, iters: int) -> float:
    """Median GPU time of a replay of ``graph`` over ``iters`` replays, after 10 unmeasured."""
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms(fn, iters: int) -> float:
    """Median GPU time of ``fn`` replayed as a CUDA graph (so Python launch overhead, which for
    a few microsecond-scale kernels exceeds their run time, is not measured)."""
    return replayed_ms(captured(fn)[0], iters)


def replay_us(fn, calls: int, reps: int = 25) -> float:
    """Median replay of ``fn`` captured in a CUDA graph, per call, in us."""
    return time_ms(fn, reps) * 1e3 / calls


def copy_rate() -> float:
    """The card's device copy rate, (read + written bytes) / median time of a 1 GiB bf16 copy, in
    bytes/s, launched directly as ``benchmarks/decode_bench.py`` times it, not captured: in a CUDA
    graph the copy read 2.43 TB/s where the same copy launched directly read 2.99 on the same H100
    (2026-12-07, one warm machine), and the decode step's weight reads run at the latter's rate."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * a.numel() * a.element_size() / (statistics.median(times) * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=32768)
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    d = args.head_dim
    k_store = torch.randn(1, args.hkv, args.capacity, d, device=dev, dtype=dt)
    v_store = torch.randn(1, args.hkv, args.capacity, d, device=dev, dtype=dt)
    q = torch.randn(1, args.hq, 1, d, device=dev, dtype=dt)
    k = torch.randn(1, args.hkv, 1, d, device=dev, dtype=dt)
    v = torch.randn(1, args.hkv, 1, d, device=dev, dtype=dt)
    rows = []
    for history in args.history:
        pos = torch.tensor([history], device=dev)
        kv_bytes = 2 * (history + 1) * args.hkv * d * k_store.element_size()
        tri = time_ms(lambda: triton_update_and_attend(q, k, v, pos, k_store, v_store, None, d**-0.5, dt), args.iters)
        por = time_ms(lambda: portable_update_and_attend(q, k, v, pos, k_store, v_store, None, d**-0.5, dt), args.iters)
        ref = portable_update_and_attend(q, k, v, pos, k_store.clone(), v_store.clone(), None, d**-0.5, dt)
        got = triton_update_and_attend(q, k, v, pos, k_store, v_store, None, d**-0.5, dt)
        row = {
            "history": history,
            "capacity": args.capacity,
            "triton_ms": tri,
            "triton_GBps": kv_bytes / tri / 1e6,
            "portable_ms": por,
            "max_abs_diff_vs_portable": float((got.float() - ref.float()).abs().max()),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
