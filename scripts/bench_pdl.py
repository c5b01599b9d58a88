"""What programmatic dependent launch (PDL, sm_90+) would take off a decode step's chain of GEMVs.

A decode step is a chain of small kernels, each waiting for the one before: on the H200 a
Llama-3.2-1B layer's q|k|v, attention, o, gate|up and down took 48.7 us where their bytes take
about 29.5 at the copy rate (``benchmarks/README.md``, session 7), a few us of fixed cost a kernel.
Under PDL a kernel's programs are scheduled while the kernel before is still running and wait on
entry (``griddepcontrol``; ``kernels/triton_base.wait_for_inputs``), so the launch and ramp of one
overlap the tail of the other. AOTInductor's launcher sets no launch attributes, so this measures
the chain eagerly launched and captured in a CUDA graph (which keeps the programmatic edges),
before any of it goes into a package.

The chain: 16 layers, each its own weights and K/V storage, of this project's decode kernels at the
1B shapes with their folds and default launches: q|k|v + RMSNorm, the one-token attention pair
(``kernels/attend_decode.py``: attend with the row write, combine; 32/8 heads of 64 over
``--history`` stored positions, no rotary rows), o + residual, gate|up + RMSNorm + SiLU*mul, down +
residual; six kernels a layer. bf16, int8 and int4 (group 128) weights. Per scheme six builds, timed in interleaved rounds: ``off`` (today's kernels),
``pdl_code`` (the wait compiled in, launched without PDL: what the instructions cost alone),
``pdl`` (launched with PDL, the graph capturing programmatic edges) and ``edges`` (launched as
``pdl_code``, the edges into the waiting kernels made programmatic after the capture by
``runtime/graph_edges.make_programmatic``: what a runtime could do to an AOTInductor package's
step, whose launcher sets no attributes); those two again as ``pdl_exit`` and ``edges_exit``, the
dependents let in as each program exits instead of at the kernel's entry (the first H100 run had
``pdl`` 8-30% slower than ``off``: programs of the next kernel scheduled at once and waiting hold
SM slots that the running kernel's later programs need). Every mode is timed as its captured graph replays; the
graph's last output must be bit-equal to the plain eager chain's, and the record counts each
graph's programmatic edges (a "pdl" capture that kept none would time "pdl_code" again).

    python scripts/bench_pdl.py --out pdl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench_attention import captured, copy_rate, replayed_ms  # scripts/, the script's own folder

from offgraph_export.kernels import triton_gemv as tg
from offgraph_export.kernels.attend_common import AttendLaunch, attention_output
from offgraph_export.kernels.attend_decode import decode_step
from offgraph_export.reference.weight_quant import quantize
from offgraph_export.runtime.graph_edges import PROGRAMMATIC, edge_types, kernel_names, make_programmatic

LAYERS = 16
HIDDEN, QKV, INTER = 2048, 3072, 8192
HQ, HKV, HEAD = 32, 8, 64
DT = torch.bfloat16
#: each mode's launch options: the wait compiled in ("pdl": "code") or also launched as PDL (True),
#: the dependents let in at the kernel's entry or as its programs exit ("pdl_trigger")
MODE_OPTIONS = {"off": {}, "pdl_code": {"pdl": "code"}, "pdl": {"pdl": True}, "edges": {"pdl": "code"},
                "pdl_exit": {"pdl": True, "pdl_trigger": "exit"}, "edges_exit": {"pdl": "code", "pdl_trigger": "exit"}}
MODES = tuple(MODE_OPTIONS)
#: the kernels that wait on entry when compiled with PDL (the edges mode makes edges into them programmatic)
WAITING = ("_gemv_kernel", "_gemv_tiles_kernel", "_gemv_mma_kernel", "_decode_attend_kernel", "_decode_combine_kernel")


def _weights(scheme: str, n: int, k: int, gen: torch.Generator) -> dict:
    w = (torch.randn(n, k, generator=gen) * 0.02).to(DT)
    if scheme == "bf16":
        return {"w": w.cuda()}
    q = quantize(w, scheme, 128 if scheme == "int4" else None)
    return {"w": q.qweight.cuda(), "scales": q.scales.cuda(), "zeros": None if q.zeros is None else q.zeros.cuda(),
            "group_size": 128 if scheme == "int4" else 0}


def _graph_ms(fn, iters: int, edges: bool) -> dict:
    """``fn`` captured, with ``edges`` the edges into the waiting kernels made programmatic,
    replayed: median ms, edges changed, programmatic edges in the graph, the kernel names seen, the
    output after the replays."""
    graph, out = captured(fn, keep_graph=True)
    raw = graph.raw_cuda_graph()
    names = sorted(set(kernel_names(raw).values()))
    changed = make_programmatic(raw, lambda name: name.startswith(WAITING)) if edges else 0
    programmatic = edge_types(raw)[PROGRAMMATIC]
    graph.instantiate()
    ms = replayed_ms(graph, iters)
    return {"ms": ms, "changed": changed, "programmatic": programmatic, "names": names, "out": out.clone()}


def _launch(x, p, mode, norm=None, residual=None, gated=False):
    quant = 0 if "scales" not in p else (4 if p["zeros"] is not None else 8)
    n, k = int(p["w"].shape[0]), int(x.shape[-1])
    config = dict(tg._config(k, gated, quant, n, False)) | MODE_OPTIONS[mode]  # edges: compiled in, launched plainly
    extra = {"scales": p.get("scales"), "zeros": p.get("zeros"), "group_size": p.get("group_size", 0)}
    return tg.gemv_launch(x, p["w"], norm, 1e-5, residual, gated, True, config, **extra)


def _attend(qkv, layer, pos, mode):
    q = qkv[:HIDDEN].view(1, HQ, 1, HEAD)
    k = qkv[HIDDEN:HIDDEN + HKV * HEAD].view(1, HKV, 1, HEAD)
    v = qkv[HIDDEN + HKV * HEAD:].view(1, HKV, 1, HEAD)
    launch = AttendLaunch.for_step(q, k, v, layer["k_store"], layer["v_store"], None, HEAD ** -0.5)
    out = attention_output(1, HQ, 1, HEAD, DT, qkv.device)
    overrides = MODE_OPTIONS[mode]
    decode_step(q, k, v, pos, layer["k_store"], layer["v_store"], out, launch, overrides=overrides)
    return out.reshape(HIDDEN)


def _chain(layers, h, mode, pos):
    for layer in layers:
        qkv = _launch(h, layer["qkv"], mode, norm=layer["norm1"])
        h = _launch(_attend(qkv, layer, pos, mode), layer["o"], mode, residual=h)
        act = _launch(h, layer["gate_up"], mode, norm=layer["norm2"], gated=True)
        h = _launch(act, layer["down"], mode, residual=h)
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--schemes", nargs="+", default=["bf16", "int8", "int4"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--history", type=int, default=1024)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": LAYERS, "history": args.history,
              "copy_TBps": copy_rate() / 1e12, "schemes": {}, "command": "python scripts/bench_pdl.py --out pdl.json"}
    for scheme in args.schemes:
        t0 = time.perf_counter()
        layers = [{"qkv": _weights(scheme, QKV, HIDDEN, gen), "o": _weights(scheme, HIDDEN, HIDDEN, gen),
                   "gate_up": _weights(scheme, 2 * INTER, HIDDEN, gen), "down": _weights(scheme, HIDDEN, INTER, gen),
                   "norm1": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(DT).cuda(),
                   "norm2": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(DT).cuda(),
                   "k_store": torch.randn(1, HKV, args.history + 64, HEAD, generator=gen).to(DT).cuda(),
                   "v_store": torch.randn(1, HKV, args.history + 64, HEAD, generator=gen).to(DT).cuda()}
                  for _ in range(LAYERS)]
        pos = torch.tensor([args.history], device="cuda")
        h0 = torch.randn(HIDDEN, generator=gen).to(DT).cuda()
        want = _chain(layers, h0, "off", pos)  # plain eager launches: the output every graph must give
        torch.cuda.synchronize()
        rounds = {mode: [] for mode in MODES}
        graphs: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for _ in range(args.rounds):
            for mode in MODES:
                try:
                    got = _graph_ms(lambda m=mode: _chain(layers, h0, m, pos), args.reps, edges=mode.startswith("edges"))
                except Exception as exc:  # noqa: BLE001 - a benchmark records what failed (a driver without the edge API, an old card)
                    errors[mode] = f"{type(exc).__name__}: {exc}"
                    rounds[mode].append(float("nan"))
                    continue
                rounds[mode].append(got["ms"] * 1e3)
                graphs[mode] = {k: v for k, v in got.items() if k != "ms"}
        equal = {mode: bool(torch.equal(g["out"], want)) for mode, g in graphs.items()}
        edges = {mode: {"changed": g["changed"], "programmatic": g["programmatic"]} for mode, g in graphs.items()}
        per_layer = {mode: statistics.median(v) / LAYERS for mode, v in rounds.items()}
        saves = {mode: 100 * (1 - per_layer[mode] / per_layer["off"]) for mode in MODES if mode != "off"}
        record["schemes"][scheme] = {"us_per_layer": per_layer, "rounds_us": rounds, "bit_equal_to_eager": equal,
                                     "saves_pct": saves, "edges": edges,
                                     "kernel_names": graphs.get("edges", graphs.get("off", {})).get("names", []),
                                     "errors": errors, "build_s": time.perf_counter() - t0}
        print(f"{scheme}: us a layer " + ", ".join(f"{m} {v:.2f}" for m, v in per_layer.items())
              + "; saves " + ", ".join(f"{m} {v:.1f}%" for m, v in saves.items())
              + f"; edges {edges}; bit-equal {equal}; errors {errors}", flush=True)
        Path(args.out).write_text(json.dumps(record, indent=1))  # what is done so far, should a later scheme fail
        del layers
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
