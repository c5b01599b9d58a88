"""What ``export`` says: a progress line as each stage finishes, and with ``--json`` a summary on
stdout of the artifact's path and size and each stage's seconds (each method's compile too). The
export is the session's one of the example (``conftest.example_export``): no compile of its own."""

from __future__ import annotations

import json
import re


def test_export_json_gives_the_path_the_size_and_every_stage_time(example_export):
    path, proc = example_export
    summary = json.loads(proc.stdout)
    assert summary["artifact"] == str(path) and summary["bytes"] == path.stat().st_size
    assert summary["methods"] == ["model"]
    stages = ["build_s", "export_s", "passes_s", "compile_s"]
    per_method = [f"compile_{m}_s" for m in summary["methods"]]
    for key in stages + per_method:
        assert isinstance(summary[key], float) and summary[key] > 0, (key, summary)
    assert sum(summary[k] for k in per_method) + summary["compile_package_s"] <= summary["compile_s"]
    # each method's compile broken into Inductor's stages (its own timers): lowering, code
    # generation and the C++ compile each took time on the cpu, and they fit in the method's time
    for method in summary["methods"]:
        stage = {name: summary[f"compile_{method}_{name}_s"]
                 for name in ("trace", "inductor", "lower", "autotune", "codegen", "triton_wait", "cpp", "cpp_header")}
        assert all(stage[name] > 0 for name in ("trace", "inductor", "lower", "codegen", "cpp")), stage
        assert stage["autotune"] <= stage["lower"] and stage["triton_wait"] <= stage["codegen"], stage
        assert 0 <= stage["cpp_header"] <= stage["cpp"], stage
        assert stage["lower"] + stage["codegen"] + stage["cpp"] <= stage["inductor"], stage
        assert abs(stage["trace"] + stage["inductor"] - summary[f"compile_{method}_s"]) < 0.01, (stage, summary)
    assert summary["compile_package_s"] > 0
    # each pass's seconds (the cpu example: no decode method), within the passes' total
    passes = [k for k in summary if k.startswith("pass_")]
    assert passes == [f"pass_{name}_s" for name in (
        "validate_kv_sites", "record_step_width", "record_positions", "bound_table_indices", "fuse_projections",
        "build_manifest", "strip_kv_cache", "functionalize")], passes
    assert all(summary[k] >= 0 for k in passes) and sum(summary[k] for k in passes) <= summary["passes_s"] + 0.01


def test_export_says_each_pass_time(example_export):
    _, proc = example_export
    assert re.search(r"\] +pass fuse_projections: \d+\.\ds$", proc.stderr, re.M), proc.stderr


def test_export_says_each_stage_time_as_it_finishes(example_export):
    _, proc = example_export
    said = [line for line in proc.stderr.splitlines() if re.match(r"\[\s*\d+\.\ds\] ", line)]
    finished = [re.sub(r"^\[\s*\d+\.\ds\] ", "", line) for line in said if " in " in line]
    assert [re.sub(r"\d+\.\ds", "Xs", line) for line in finished] == [
        "built in Xs", "exported in Xs", "passes done in Xs",
        "compiled method 'model' in Xs (tracing Xs; lowering Xs, of which autotuning Xs; code generation Xs, of which "
        "waiting for kernels Xs; C++ Xs, of which the precompiled header Xs)",
        "packaged the weights and methods in Xs", "compiled in Xs",
    ], proc.stderr
