"""benchmarks/report.py renders whatever a run measured: every variant of this project that has a
build record and results (a variant missing from a fixed list once dropped silently), the
replay-alone column, the speed-up against the best static-cache replay, and the step
decomposition (in-graph idle, host work before the replay) from the unprofiled timings."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPORT = Path(__file__).resolve().parent.parent / "benchmarks" / "report.py"


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _row(contender, mode, history, ms, replay=None):
    row = {"contender": contender, "mode": mode, "history": history, "median_ms": ms, "p90_ms": ms * 1.01,
           "tokens_per_s": 1e3 / ms, "gb_per_s": 2500.0, "pct_of_floor": 50.0, "kv_bytes": 67_108_864}
    if replay is not None:
        row["replay_ms"] = replay
    return row


def _breakdown(total):
    return {"us_per_step": {"gemm": total - 100, "attention": 100}, "kernels_per_step": {"gemm": 66, "attention": 32},
            "total_us": total, "top_kernels_us": {}}


def test_report_lists_every_measured_variant_with_replay_and_decomposition(tmp_path):
    def dump(name, data):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    build = {"export_s": 4, "passes_s": 30, "compile_s": 140, "bytes": 2_479_000_000}
    for name, step, replay in (("offgraph", 1.045, 0.965), ("offgraph-unfused", 1.551, 1.450)):
        dump(f"{name}_build", build)
        dump(name, {"rows": [_row(name, "graph", 1024, step, replay), _row(name, "ordinary", 1024, step + 0.1)],
                    "prefill_1024": {"median_ms": 6.0}, "breakdown_1k": {"graph": _breakdown(937.0)}})
    dump("offgraph-gemv_build", build)  # built, never measured: not listed
    dump("hf_compile", {"compile_s": 69, "rows": [_row("hf-compile", "graph", 1024, 2.495)],
                        "breakdown_1k": {"graph": _breakdown(2427.0)}})
    text = _report().render(tmp_path)
    assert "offgraph-unfused" in text and "offgraph-gemv" not in text
    assert "| 1,024 | offgraph 1.045 (0.965) ms | hf-compile 2.495 ms | 2.39x (2.59x) |" in text
    # the default build's breakdown row: in-graph idle = 965 - 937, host before replay = 1045 - 965
    assert "| offgraph | graph | 1,024 | 837 | 100 | 0 | 0 | 0 | 937 | 98 | 28 | 80 |" in text
    assert "| hf_compile | graph | 1,024 | 2327 | 100 | 0 | 0 | 0 | 2427 | 98 | 68 | (not timed) |" in text
    assert text.index("| 1,024 | offgraph 1.045") < text.index("| 1,024 | offgraph-unfused 1.551")


def test_report_compares_with_the_gptfast_contender_and_lists_its_quantized_rows(tmp_path):
    def dump(name, data):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    dump("offgraph_build", {"export_s": 4, "passes_s": 30, "compile_s": 140, "bytes": 2_479_000_000})
    dump("offgraph", {"rows": [_row("offgraph", "graph", 1024, 1.0, 0.95)], "prefill_1024": {"median_ms": 6.0}})
    dump("hf_compile", {"compile_s": 69, "rows": [_row("hf-compile", "graph", 1024, 2.5)]})
    dump("gptfast", {"compile_s": {"1024": 72.0}, "rows": [_row("gptfast", "graph", 1024, 1.3)],
                     "breakdown_1k": {"graph": _breakdown(1250.0)}})
    dump("gptfast_int4", {"compile_s": {"1024": 80.0}, "rows": [_row("gptfast-int4", "graph", 1024, 0.9)]})
    text = _report().render(tmp_path)
    # the best float contender is the gpt-fast one; its int4 row is listed but not the comparison
    assert "| 1,024 | offgraph 1.000 (0.950) ms | gptfast 1.300 ms | 1.30x (1.37x) |" in text
    assert "| gptfast-int4 | graph | 1,024 | 0.900 |" in text
    assert "| gptfast | compiled per cache length (1,024: 72 s) | - | - |" in text
    assert "| gptfast | graph | 1,024 | 1150 | 100 |" in text


def test_report_compares_quantized_builds_with_the_same_scheme_and_with_bf16(tmp_path):
    """A quantized build is compared with the gpt-fast-style contender of its scheme and with this
    project's bf16 build (issue 26's >= 1.8x), not with the float contenders, and the header names
    its floor's weight bytes."""
    def dump(name, data):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    build = {"export_s": 4, "passes_s": 30, "compile_s": 140, "bytes": 1_000_000_000}
    dump("floor", {"copy_bytes_per_s": 4.1e12, "weight_bytes": 2_471_000_000, "kv_bytes_per_token": 32768,
                   "variant_weight_bytes": {"offgraph-int4": 656_000_000, "offgraph-int8": 1_237_000_000}})
    for name, step in (("offgraph", 1.0), ("offgraph-int4", 0.5)):
        dump(f"{name}_build", build)
        dump(name, {"rows": [_row(name, "graph", 1024, step, step - 0.05)], "prefill_1024": {"median_ms": 6.0}})
    dump("hf_compile", {"compile_s": 69, "rows": [_row("hf-compile", "graph", 1024, 2.5)]})
    dump("gptfast_int4", {"compile_s": {"1024": 80.0}, "rows": [_row("gptfast-int4", "graph", 1024, 1.1)]})
    text = _report().render(tmp_path)
    assert "offgraph-int4 0.66 GB" in text and "offgraph-int8" not in text  # int8 was not measured
    assert "| 1,024 | offgraph-int4 0.500 ms (50% of its floor) | gptfast-int4 1.100 ms | 2.20x | offgraph 1.000 ms | 2.00x |" in text
    # the float comparison lists the bf16 build only
    assert "| 1,024 | offgraph 1.000 (0.950) ms | hf-compile 2.500 ms | 2.50x (2.63x) |" in text
    assert "| 1,024 | offgraph-int4 0.500 (0.450) ms |" not in text


def test_a_build_stopped_after_publishing_its_package_is_reported_without_stage_times(tmp_path):
    """scripts/gpu_8b.sh measures a package its build published before being stopped and writes a
    record with a note and no stage times (a Qwen2.5-7B build, 2026-12-07): the report says so in
    the build table instead of failing on the missing times."""
    note = "the build process was stopped (rc 124) after its package was published"
    (tmp_path / "offgraph_build.json").write_text(json.dumps({"note": note, "timed_out": True}))
    (tmp_path / "offgraph.json").write_text(json.dumps({
        "rows": [_row("offgraph", "graph", 1024, 5.596, 5.438)], "prefill_1024": {"median_ms": 40.0},
        "breakdown_1k": {"graph": _breakdown(5390.0)}}))
    text = _report().render(tmp_path)
    assert f"| offgraph | not known: {note} | - | 40.00 ms |" in text
    assert "| offgraph | graph | 1,024 | 5.596 |" in text
