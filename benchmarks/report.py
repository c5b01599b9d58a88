"""Render a ``benchmarks/run.sh`` output folder: ``report.md`` (tables) and ``report.png`` (tokens/s
and KV bytes against history; needs matplotlib, skipped with a note otherwise).

    python benchmarks/report.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


#: the static-cache contenders' result files (``gptfast*``: ``benchmarks/gptfast.py``); every other
#: ``NAME.json`` with a ``NAME_build.json`` beside it is one of this project's variants
#: (``decode_bench.py`` VARIANTS, whichever ran)
GPTFAST = ("gptfast", "gptfast_int8", "gptfast_int4")
THEIRS = ("hf_aoti", "hf_compile", *GPTFAST)
#: the float contenders this project's bf16 rows are compared with (the quantized gptfast rows are
#: listed, not compared: they read other bytes)
FLOAT_THEIRS = ("hf-aoti", "hf-compile", "gptfast")
#: this project's quantized variants (``decode_bench.py`` QUANTIZED) by their scheme: compared with
#: the gpt-fast-style contender of the same scheme and with this project's bf16 build
SCHEMES = ("int8", "int4")


def _scheme(name: str) -> str | None:
    """``int8``/``int4`` for a quantized variant (``offgraph-int4``), None for a float one."""
    return next((s for s in SCHEMES if name.endswith(f"-{s}")), None)


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _ours(out: Path) -> list[str]:
    """This project's variants measured in ``out``, the default build first."""
    names = [p.name[: -len("_build.json")] for p in out.glob("*_build.json")]
    names = [n for n in names if n not in THEIRS and (out / f"{n}.json").exists()]
    return sorted(names, key=lambda n: (n != "offgraph", n))


def _versus(row: dict | None, step_ms: float) -> str:
    """Two cells: the other row's contender and ms, and how many times faster ``step_ms`` is."""
    return f"{row['contender']} {row['median_ms']:.3f} ms | {row['median_ms'] / step_ms:.2f}x" if row else "- | -"


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.0f} MB"


def render(out: Path) -> str:
    floor = _load(out, "floor") or {}
    ours = _ours(out)
    results = {name: _load(out, name) for name in (*ours, *THEIRS)}
    builds = {name: _load(out, f"{name}_build") for name in (*ours, "hf_aoti")}
    rows = [r for res in results.values() if res for r in res["rows"]]
    lines = ["# Decode side by side", ""]
    if floor:
        lines += [
            f"Copy rate {floor['copy_bytes_per_s'] / 1e12:.2f} TB/s (1 GiB device copy, read + write); "
            f"weights {floor['weight_bytes'] / 1e9:.2f} GB; K/V {floor['kv_bytes_per_token']:,} bytes per token. "
            "Floor = (weights + live K/V) / copy rate.", "",
        ]
        quantized = floor.get("variant_weight_bytes") or {}
        if any(name in quantized for name in ours):
            lines += ["Quantized builds' floors count the weights they store: " + "; ".join(
                f"{name} {quantized[name] / 1e9:.2f} GB" for name in ours if name in quantized) + ".", ""]
    lines += [
        "This project's rows time the runtime's whole step (inputs, admission, positions, growth check, "
        "the program or its graph's replay, commit); `replay` is its captured graph replayed alone; `loop` "
        "rows time `generate`'s greedy loop (the time between tokens reaching the host, the next step queued "
        "before a token is read). The static-cache contenders' graph rows time the replay alone (their inputs "
        "are set once).", "",
        "| contender | launch | history | ms/token (median) | p90 | replay alone | tokens/s | GB/s | % of floor | KV bytes allocated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["history"], r["contender"], r["mode"])):
        replay = f"{r['replay_ms']:.3f}" if "replay_ms" in r else "-"
        lines.append(
            f"| {r['contender']} | {r['mode']} | {r['history']:,} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {replay} | "
            f"{r['tokens_per_s']:.0f} | {r['gb_per_s']:.0f} | {r['pct_of_floor']:.0f}% | {_mb(r['kv_bytes'])} |"
        )
    graph = {(r["contender"], r["history"]): r for r in rows if r["mode"] == "graph"}
    loops = {(r["contender"], r["history"]): r for r in rows if r["mode"] == "loop"}
    histories = sorted({r["history"] for r in rows})
    lines += ["", "| history | ours, CUDA graph: step (replay alone) | best static-cache path, CUDA graph replay | speed-up: step (replay) |",
              "|---|---|---|---|"]
    for name in ours:
        for h in histories:
            mine = graph.get((name, h))
            theirs = [(graph[(c, h)]["median_ms"], c) for c in FLOAT_THEIRS if (c, h) in graph and not _scheme(name)]
            if mine and theirs:
                best, who = min(theirs)
                step, replay = mine["median_ms"], mine.get("replay_ms")
                alone = f" ({replay:.3f})" if replay else ""
                ratio = f" ({best / replay:.2f}x)" if replay else ""
                lines.append(f"| {h:,} | {name} {step:.3f}{alone} ms | {who} {best:.3f} ms | {best / step:.2f}x{ratio} |")
    quantized_rows = []
    for name in ours:
        scheme = _scheme(name)
        for h in histories if scheme else ():
            mine, theirs, bf16 = graph.get((name, h)), graph.get((f"gptfast-{scheme}", h)), graph.get(("offgraph", h))
            if mine and (theirs or bf16):
                step = mine["median_ms"]
                loop = loops.get((name, h))
                loop_cell = "-" if not loop else f"{loop['median_ms']:.3f} ms" + (
                    f" ({theirs['median_ms'] / loop['median_ms']:.2f}x)" if theirs else "")
                quantized_rows.append(f"| {h:,} | {name} {step:.3f} ms ({mine['pct_of_floor']:.0f}% of its floor) | "
                                      f"{_versus(theirs, step)} | {_versus(bf16, step)} | {loop_cell} |")
    if quantized_rows:
        lines += ["", "| history | ours quantized, CUDA graph step | gpt-fast-style, same scheme | speed-up | ours bf16 | speed-up | greedy loop (speed-up) |",
                  "|---|---|---|---|---|---|---|", *quantized_rows]
    lines += ["", "| contender | export + compile | package | prefill of 1024 tokens (median) |", "|---|---|---|---|"]
    for name in ours:
        ob = builds[name]
        if not ob:
            continue
        pre = results[name]["prefill_1024"]["median_ms"] if results[name] else None
        if "compile_s" not in ob:  # a build stopped after publishing its package (scripts/gpu_8b.sh)
            lines.append(f"| {name} | not known: {ob.get('note', 'no stage times recorded')} | - | "
                         f"{'-' if pre is None else f'{pre:.2f} ms'} |")
            continue
        lines.append(
            f"| {name} | {ob['export_s'] + ob['passes_s'] + ob['compile_s']:.0f} s (export {ob['export_s']:.0f}, "
            f"passes {ob['passes_s']:.0f}, compile {ob['compile_s']:.0f}) | {_mb(ob['bytes'])} | "
            f"{'-' if pre is None else f'{pre:.2f} ms'} |"
        )
    ab = builds["hf_aoti"]
    if ab:
        lines.append(
            f"| hf-aoti | {ab['export_s'] + ab['compile_s']:.0f} s (export {ab['export_s']:.0f}, compile "
            f"{ab['compile_s']:.0f}) | {_mb(ab['bytes'])} | - (exported for one token a step) |"
        )
    if results["hf_compile"]:
        first = _load(out, "hf_compile_build") or results["hf_compile"]  # BENCH_PHASE=build compiled it first
        lines.append(f"| hf-compile | {first['compile_s']:.0f} s (first call) | - | - |")
    for name in GPTFAST:
        if results[name]:
            compiled = ", ".join(f"{int(h):,}: {s:.0f} s" for h, s in results[name]["compile_s"].items())
            lines.append(f"| {name.replace('_', '-')} | compiled per cache length ({compiled}) | - | - |")
    eager = _load(out, "hf_eager_prefill")
    if eager:
        lines.append(f"| hf-eager | - | - | {eager['median_ms']:.2f} ms |")
    lines += ["", "GPU time of one decode step by kernel class (torch.profiler, us). For this project's CUDA-graph rows, "
              "`in-graph idle` = replay alone minus the kernels' time and `host before replay` = the whole step "
              "minus the replay alone (both from the unprofiled timings at that history; the kernels' time includes the "
              "step's input and output copies outside the graph, a few us):", ""]
    classes = ["gemm", "attention", "pointwise/norm", "copy", "other"]
    lines += ["| contender | launch | history | " + " | ".join(classes) + " | total | kernels | in-graph idle | host before replay |",
              "|---|---|---|" + "---|" * (len(classes) + 4)]
    first = histories[0] if histories else 0
    for name, res in results.items():
        parts = [(first, (res or {}).get("breakdown_1k") or {})]
        last = dict((res or {}).get("breakdown_last") or {})
        if last:
            parts.append((last.pop("history"), last))
        for history, per_mode in parts:
            for mode, b in per_mode.items():
                if not b:
                    continue
                cells = [f"{b['us_per_step'].get(c, 0):.0f}" for c in classes]
                row = graph.get((name.replace("_", "-"), history)) if mode == "graph" else None
                idle = host = "-"
                if row and row.get("replay_ms"):
                    idle = f"{row['replay_ms'] * 1e3 - b['total_us']:.0f}"
                    host = f"{(row['median_ms'] - row['replay_ms']) * 1e3:.0f}"
                elif row and name in THEIRS:  # their graph rows are the replay alone
                    idle, host = f"{row['median_ms'] * 1e3 - b['total_us']:.0f}", "(not timed)"
                lines.append(f"| {name} | {mode} | {history:,} | " + " | ".join(cells) + f" | {b['total_us']:.0f} | "
                             f"{sum(b['kernels_per_step'].values())} | {idle} | {host} |")
    return "\n".join(lines) + "\n"


def plot(out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: report.png not written"
    rows = [r for name in (*_ours(out), *THEIRS) if (d := _load(out, name)) for r in d["rows"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["contender"], r["mode"]) for r in rows}):
        sel = sorted((r for r in rows if (r["contender"], r["mode"]) == key), key=lambda r: r["history"])
        xs = [r["history"] for r in sel]
        ax1.plot(xs, [r["tokens_per_s"] for r in sel], marker="o", label=f"{key[0]} ({key[1]})")
        ax2.plot(xs, [r["kv_bytes"] / 1e6 for r in sel], marker="o", label=f"{key[0]} ({key[1]})")
    ax1.set(xlabel="history (tokens)", ylabel="decode tokens/s", title="Decode throughput, batch 1")
    ax2.set(xlabel="history (tokens)", ylabel="KV bytes allocated (MB)", title="KV cache memory")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "report.png", dpi=120)
    return f"wrote {out / 'report.png'}"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    text = render(out)
    (out / "report.md").write_text(text)
    print(text)
    print(plot(out))


if __name__ == "__main__":
    main()
