"""Render a ``benchmarks/run_batch.sh`` output folder: ``report.md`` (tables) and ``report.png``
(aggregate tokens/s against B, one line per contender and history; needs matplotlib, skipped with
a note otherwise).

    python benchmarks/report_batch.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = {"batched": 0, "single": 1, "hf-static": 2}
CLASSES = ["gemm", "attention", "pointwise/norm", "copy", "other"]


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _gb(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def render(out: Path) -> str:
    data = _load(out, "batch_measure")
    if data is None:
        return f"# Batched decode\n\nno batch_measure.json in {out}\n"
    rows = data["rows"]
    floor, env, args = data.get("floor", {}), data.get("env", {}), data.get("args", {})
    lines = ["# Aggregate decode throughput, B sessions side by side", ""]
    lines += [
        f"{env.get('device')}, torch {env.get('torch')}, transformers {env.get('transformers')}, triton {env.get('triton')}; "
        f"`--batches {' '.join(map(str, args.get('batches', [])))} --history {' '.join(map(str, args.get('history', [])))} "
        f"--steps {args.get('steps')}`.", "",
    ]
    if floor:
        lines += [
            f"Copy rate {floor['copy_bytes_per_s'] / 1e12:.2f} TB/s (1 GiB device copy, read + write); weights "
            f"{floor['weight_bytes'] / 1e9:.2f} GB; K/V {floor['kv_bytes_per_token']:,} bytes per token. Floor of a step of B "
            "tokens = (weights + every session's live K/V) / copy rate.", "",
        ]
    lines += [f"- {note}" for note in data.get("notes", [])]
    groups = data.get("groups")
    if groups:
        lines.append("- sessions used per B: " + ", ".join(f"B={b}: {a}-{z}" for b, (a, z) in groups.items())
                     + " (a later B reuses earlier sessions where they do not fit disjoint: `context` is the mean context it ran at)")
    lines += ["", "| contender | B | history | context | ms/step (median) | p90 | tokens/s | % of floor | GB/s | KV allocated | KV live | KV pages of the B |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["history"], r["batch"], ORDER.get(r["contender"], 9))):
        lines.append(
            f"| {r['contender']} | {r['batch']} | {r['history']:,} | {r['context_mean']:,.0f} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['pct_of_floor']:.0f}% | {r['gb_per_s']:,.0f} | {_gb(r.get('kv_allocated_bytes'))} | "
            f"{_gb(r.get('kv_live_bytes'))} | {_gb(r.get('kv_pages_bytes'))} |"
        )
    by = {(r["contender"], r["batch"], r["history"]): r for r in rows}
    keys = sorted({(r["history"], r["batch"]) for r in rows})
    lines += ["", "Speed-up of `batched` (aggregate tokens/s):", "",
              "| history | B | batched tokens/s | over single | over hf-static |", "|---|---|---|---|---|"]
    for history, batch in keys:
        mine = by.get(("batched", batch, history))
        if not mine:
            continue
        cells = []
        for other in ("single", "hf-static"):
            theirs = by.get((other, batch, history))
            cells.append(f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" if theirs else "-")
        lines.append(f"| {history:,} | {batch} | {mine['tokens_per_s']:,.0f} | " + " | ".join(cells) + " |")
    if data.get("ttft"):
        lines += ["", "Time to first token of a session joining while a batch decodes (median of the repeats after a warm-up; "
                  "batched: its prompt packed beside the decode tokens, `steps` steps; single: one round of the B sessions, "
                  "then its prefill):", "",
                  "| contender | decoding B | history | prompt | TTFT ms | steps | mixed step ms / its prefill ms | decode-only step ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in data["ttft"]:
            plain = by.get((t["contender"], t["batch"], t["history"]))
            mixed = t.get("mixed_step_ms", t.get("prefill_ms"))
            lines.append(f"| {t['contender']} | {t['batch']} | {t['history']:,} | {t['prompt']:,} | {t['ttft_ms']:.2f} | {t['steps']} | "
                         f"{mixed:.2f} | {plain['median_ms']:.3f} |" if plain else
                         f"| {t['contender']} | {t['batch']} | {t['history']:,} | {t['prompt']:,} | {t['ttft_ms']:.2f} | {t['steps']} | {mixed:.2f} | - |")
    if data.get("prefill"):
        lines += ["", "Prefill of the measured sessions (chunks of max_write; the batched runner packs several sessions a step):", "",
                  "| contender | to history | sessions | tokens | steps | seconds | tokens/s |", "|---|---|---|---|---|---|---|"]
        for p in data["prefill"]:
            lines.append(f"| {p['contender']} | {p['history']:,} | {p['sessions']} | {p['tokens']:,} | {p['steps']} | "
                         f"{p['seconds']:.2f} | {p['tokens_per_s']:,.0f} |")
    breakdown = {k: v for k, v in data.get("breakdown", {}).items() if v.get("us_per_step")}
    if breakdown:
        lines += ["", "GPU time of one step by kernel class (torch.profiler, us per step; single: one round of B session steps; "
                  "`idle` = the unprofiled median step minus the kernels' time: host work and launch gaps):", "",
                  "| contender | B | history | " + " | ".join(CLASSES) + " | total | kernels | idle |", "|---|---|---|" + "---|" * (len(CLASSES) + 3)]
        for name, b in breakdown.items():
            contender = name.split("@")[0]
            row = by.get((contender, b["batch"], b["history"]))
            idle = f"{row['median_ms'] * 1e3 - b['total_us']:.0f}" if row else "-"
            cells = [f"{b['us_per_step'].get(c, 0):.0f}" for c in CLASSES]
            lines.append(f"| {contender} | {b['batch']} | {b['history']:,} | " + " | ".join(cells) +
                         f" | {b['total_us']:.0f} | {sum(b['kernels_per_step'].values())} | {idle} |")
        for name, b in breakdown.items():
            top = ", ".join(f"`{k[:60]}` {v:.0f}" for k, v in list(b.get("top_kernels_us", {}).items())[:6])
            lines.append(f"\n{name} (B={b['batch']}) top kernels, us per step: {top}")
        seq_lines = []
        for name, b in breakdown.items():
            for key, label in (("sequence", f"B={b['batch']}"), ("sequence_b1", "B=1")):
                q = b.get(key)
                if q and q.get("kernels"):
                    worst = ", ".join(f"{g['us']:.0f} before `{g['before'][:40]}`" for g in q["largest_gaps"][:3])
                    seq_lines.append(f"| {name} | {label} | {q['kernels']} | {q['span_us']:.0f} | {q['busy_us']:.0f} | "
                                     f"{q['gaps_us']:.0f} | {q['median_gap_us']:.2f} | {worst} |")
        if seq_lines:
            lines += ["", "One step's kernels in launch order (torch.profiler; span = first kernel's start to the last one's end; "
                      "gaps = GPU idle between consecutive kernels inside it):", "",
                      "| contender | step | kernels | span us | busy us | gaps us | median gap us | largest gaps (us) |",
                      "|---|---|---|---|---|---|---|---|", *seq_lines]
        for name, b in breakdown.items():
            r = b.get("replay_only")
            row = by.get((name.split("@")[0], b["batch"], b["history"]))
            if r and row:
                lines.append(f"\n{name} B={b['batch']}: the width-{r['width']} CUDA graph replayed alone {r['median_ms']:.3f} ms "
                             f"against the whole step {row['median_ms']:.3f} ms: the runner's host work and input copies "
                             f"{(row['median_ms'] - r['median_ms']) * 1e3:.0f} us")
    builds = data.get("builds") or (_load(out, "batch_build") or {}).get("builds", {})
    if builds:
        lines += ["", "Builds (the build phase runs them at once: their times overlap):", "",
                  "| build | wall | export / passes / compile | package | methods | command |", "|---|---|---|---|---|---|"]
        for name, b in builds.items():
            if "compile_s" in b and "export_s" not in b:  # an hf-static compile
                batch = str(b.get("batch"))
                # measure-phase compiles by B (older records) or by "BxROWS", one per cache size
                warm = [v for k, v in data.get("hf_compile", {}).items() if k == batch or k.startswith(batch + "x")]
                again = f"; again in the measure phase {sum(warm):.0f} s" if warm else ""
                sizes = b.get("cache_lens") or [b.get("max_cache_len")]
                lines.append(f"| {name} | {b['compile_s']:.0f} s (first calls, {b.get('mode')}, cache rows "
                             f"{', '.join(map(str, sizes))}{again}) | - | - | - | - |")
                continue
            lines.append(f"| {name} | {b.get('wall_s', 0):.0f} s | {b.get('export_s', 0):.0f} / {b.get('passes_s', 0):.0f} / "
                         f"{b.get('compile_s', 0):.0f} s | {_gb(b.get('bytes'))} | {', '.join(b.get('methods', []))} | `{b.get('command', '')}` |")
    if data.get("loads"):
        lines += ["", "Package load: " + ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in data["loads"].items())]
        staged = {k: v for k, v in data["loads"].items() if v.get("stages")}
        if staged:  # Artifact.load_seconds (and the batched runner's set-up)
            lines += ["", "| load | " + " | ".join(next(iter(staged.values()))["stages"]) + " | runner |",
                      "|---|" + "---|" * (len(next(iter(staged.values()))["stages"]) + 1)]
            for k, v in staged.items():
                runner = f"{v['runner']:.1f} s" if "runner" in v else "-"
                lines.append(f"| {k} | " + " | ".join(f"{x:.1f} s" for x in v["stages"].values()) + f" | {runner} |")
    if data.get("skipped"):
        lines += ["", "Skipped:", ""] + [f"- {s['what']}: {s['why']}" for s in data["skipped"]]
    if data.get("errors"):
        lines += ["", "Errors:", ""] + [f"- {e['what']}: {e['error'][:300]}" for e in data["errors"]]
    return "\n".join(lines) + "\n"


def plot(out: Path) -> str:
    data = _load(out, "batch_measure")
    if not data or not data["rows"]:
        return "no rows: report.png not written"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: report.png not written"
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contenders = sorted({r["contender"] for r in rows}, key=lambda c: ORDER.get(c, 9))
    histories = sorted({r["history"] for r in rows})
    styles = ["-", "--", ":", "-."]
    for contender, history in sorted({(r["contender"], r["history"]) for r in rows}, key=lambda k: (ORDER.get(k[0], 9), k[1])):
        sel = sorted((r for r in rows if (r["contender"], r["history"]) == (contender, history)), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in sel], [r["tokens_per_s"] for r in sel], marker="o", color=f"C{contenders.index(contender)}",
                linestyle=styles[histories.index(history) % len(styles)], label=f"{contender}, {history:,} history")
    ax.set(xlabel="concurrent sessions B", ylabel="aggregate decode tokens/s", title="Decode throughput of B sessions")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
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
