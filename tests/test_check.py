"""The spec check (the CI lowering check): it passes for the compiled example, and fails loudly,
from Python and from the CLI, on deliberately broken artifacts: a program that writes one row too
many, a width spec that disagrees with the compiled program, and missing or corrupt packages."""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from offgraph_export.errors import ArtifactError, CheckFailed, OffgraphError
from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.frontends import load_bundle
from offgraph_export.pipeline import export_model, lower, run_passes
from offgraph_export.runtime import Artifact
from offgraph_export.check import CheckReport, assert_artifact_matches, check_artifact
from offgraph_export.specs.artifact import SPECS_ENTRY, read_artifact_specs
from tests.archive_tools import rewrite, specs_edit
from tests.conftest import EXAMPLE, cli

# -- the example passes ---------------------------------------------------------------------------


def test_check_passes_for_the_example(loaded_example, example_bundle):
    manifest = loaded_example.specs.manifest
    assert {l.layer_id: l.policy for l in manifest.layers} == {0: "flat", 1: "ring"}
    report = check_artifact(loaded_example, example_bundle)
    assert report.passed, report.render()
    assert not report.problems
    # on cpu the example has no decode method: its one-token steps ran the general program, which
    # AOTInductor compiled for widths from 2, at width 2 (the token repeated), and the report says so
    assert len(report.notes) == 1 and "one-token steps ran the general program at width 2" in report.notes[0], report.notes
    assert report.growths >= 2
    assert report.ring_wraps == {"1": True}
    assert len(report.steps) == len(report.schedule) >= 3 + 16
    assert sum(1 for w in report.schedule if w > 1) >= 3 and report.schedule[-16:] == [1] * 16
    assert sum(1 for s in report.steps if s.grew_to) == report.growths
    ring_rows = 16 + 32 - 1
    for step in report.steps:
        assert step.ok and step.width_from_spec == step.width
        positions = list(range(step.start, step.start + step.width))
        assert step.rows_written["k_cache_0"] == positions == step.rows_written["v_cache_0"]
        assert step.rows_written["k_cache_1"] == sorted(p % ring_rows for p in positions)
        assert step.max_abs_err <= step.tolerance
    assert "PASSED" in report.render()


def test_assert_artifact_matches_passes_and_returns_the_report(example_artifact, example_factory):
    """From a path and a factory name, as a user's CI test would call it."""
    report = assert_artifact_matches(example_artifact, example_factory, decode_steps=4, prefill_chunks=2, seed=5)
    assert isinstance(report, CheckReport) and report.passed
    assert report.model == example_factory and report.seed == 5
    assert report.growths >= 2 and report.ring_wraps == {"1": True}


def test_cli_check_passes(example_artifact):
    proc = cli("check", str(example_artifact), "--model", EXAMPLE)
    assert proc.returncode == 0
    assert "PASSED" in proc.stdout and "FAIL" not in proc.stdout.replace("PASSED", "")
    assert "ring wraps: layer 1: yes" in proc.stdout


def test_cli_check_json(example_artifact):
    proc = cli("check", str(example_artifact), "--model", EXAMPLE, "--json", "--steps", "6", "--prefill-chunks", "4", "--seed", "2")
    data = json.loads(proc.stdout)
    assert data["passed"] is True and data["problems"] == []
    assert data["growths"] >= 2 and data["ring_wraps"] == {"1": True}
    assert data["seed"] == 2 and data["schedule"][-6:] == [1] * 6 and len(data["schedule"]) >= 10
    assert all(step["width_from_spec"] == step["width"] for step in data["steps"])


# -- a program that writes one row too many -------------------------------------------------------


def writes_one_row_too_many(q, k, v, position, k_store, v_store, window, scale, out_dtype):
    """The portable step, plus a copy of the step's last K/V row written one row further.
    Outputs are unaffected (no query of the step can see that row); only the storage is wrong."""
    out = portable_update_and_attend(q, k, v, position, k_store, v_store, window, scale, out_dtype)
    extra = torch.remainder(position.reshape(-1)[-1:] + 1, k_store.shape[2])
    k_store.index_copy_(2, extra, k[:, :, -1:].to(k_store.dtype))
    v_store.index_copy_(2, extra, v[:, :, -1:].to(v_store.dtype))
    return out


@pytest.fixture(scope="module")
def broken_artifact(tmp_path_factory) -> Path:
    """The example through the real pipeline with the broken step (the one extra compile)."""
    bundle = load_bundle(EXAMPLE)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model, inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, step_impl=writes_one_row_too_many)
    assert program.step_impl == "writes_one_row_too_many"
    path = tmp_path_factory.mktemp("broken") / "one_row_too_many.pt2"
    return lower(program, path, "cpu", model=EXAMPLE, model_args={}, model_dtype=None)


def test_broken_artifact_loads_and_agrees_with_its_specs(broken_artifact):
    """Nothing in the package itself is inconsistent: only replaying steps can find the bug."""
    artifact = Artifact.load(broken_artifact)
    assert artifact.specs.step_impl == "writes_one_row_too_many"
    assert artifact.specs.step_width.format() == "0:1"


def test_check_fails_on_a_program_that_writes_one_row_too_many(broken_artifact, example_bundle):
    report = check_artifact(broken_artifact, example_bundle)
    assert report.passed is False
    first = report.steps[0]
    width = first.width
    assert not first.ok
    # the outputs still match eager: the row check is what catches it
    assert first.max_abs_err <= first.tolerance
    assert first.rows_written["k_cache_0"] == list(range(width + 1))
    assert first.rows_written["k_cache_1"] == list(range(width + 1))
    assert f"k_cache_0: rows written [0, {width + 1}), expected [0, {width})" in first.problems[0]
    assert any(f"spec width {width} but {width + 1} rows written" in p for p in first.problems)
    assert all(not s.ok for s in report.steps)
    text = report.render()
    assert "FAILED" in text and "rows written" in text


def test_assert_artifact_matches_raises_check_failed(broken_artifact, example_bundle):
    with pytest.raises(AssertionError) as info:  # a CheckFailed is an AssertionError: plain pytest
        assert_artifact_matches(broken_artifact, example_bundle, decode_steps=2)
    err = info.value
    assert isinstance(err, CheckFailed)
    assert isinstance(err.report, CheckReport) and err.report.passed is False
    assert "FAILED" in str(err) and "rows written" in str(err) and "expected" in str(err)


def test_cli_check_fails_with_a_readable_diff(broken_artifact):
    proc = cli("check", str(broken_artifact), "--model", EXAMPLE, "--steps", "2", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "FAILED" in proc.stdout
    assert "rows written [0, " in proc.stdout and "expected [0, " in proc.stdout
    assert "FAIL 0" in proc.stdout  # the failing step is marked in the table

    proc = cli("check", str(broken_artifact), "--model", EXAMPLE, "--steps", "2", "--json", check=False)
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["passed"] is False and any("rows written" in p for p in data["steps"][0]["problems"])


# -- packages whose archive disagrees with the compiled program -----------------------------------


@pytest.fixture
def wrong_width_artifact(example_artifact, tmp_path) -> Path:
    """The compiled program says '0:1' (tokens dim 1); the archive now says '1:0' (position dim
    0): a valid spec for these inputs, naming the same dynamic size, but not the compiled one."""

    def change(specs):
        assert specs["step_width"] == "0:1"
        specs["step_width"] = "1:0"

    return rewrite(example_artifact, tmp_path / "wrong_width.pt2", specs_edit(change))


def test_wrong_width_spec_is_valid_looking_but_fails_to_load(wrong_width_artifact):
    assert read_artifact_specs(wrong_width_artifact).step_width.format() == "1:0"  # the archive alone is fine
    with pytest.raises(ArtifactError, match=r"step width in the archive \('1:0'\) disagrees with the compiled program's \('0:1'\)"):
        Artifact.load(wrong_width_artifact)


def test_cli_check_refuses_wrong_width_spec(wrong_width_artifact):
    proc = cli("check", str(wrong_width_artifact), "--model", EXAMPLE, check=False)
    assert proc.returncode == 2, proc.stdout
    assert "error:" in proc.stderr and "'1:0'" in proc.stderr and "'0:1'" in proc.stderr
    assert "PASSED" not in proc.stdout


def test_manifest_disagreeing_with_the_program_fails_to_load(example_artifact, tmp_path):
    def change(specs):
        specs["manifest"]["max_capacity"] = 512

    path = rewrite(example_artifact, tmp_path / "wrong_manifest.pt2", specs_edit(change))
    assert read_artifact_specs(path).manifest.max_capacity == 512
    with pytest.raises(ArtifactError, match="manifest in the archive disagrees"):
        Artifact.load(path)


def test_rewritten_but_unchanged_package_still_loads(example_artifact, tmp_path):
    """Control for the tests above: the rewrite itself breaks nothing."""
    path = rewrite(example_artifact, tmp_path / "same.pt2", lambda name, data: data)
    assert Artifact.load(path).specs == read_artifact_specs(example_artifact)


# -- missing and corrupt packages -----------------------------------------------------------------


def _missing(tmp_path, good):
    return tmp_path / "nope" / "missing.pt2"


def _not_a_zip(tmp_path, good):
    path = tmp_path / "text.pt2"
    path.write_text("this is not a zip archive\n")
    return path


def _truncated(tmp_path, good):
    path = tmp_path / "truncated.pt2"
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return path


def _zip_not_pt2(tmp_path, good):
    path = tmp_path / "plain.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    return path


def _no_specs_entry(tmp_path, good):
    return rewrite(good, tmp_path / "nospecs.pt2", lambda n, d: None if n.endswith(SPECS_ENTRY) else d)


def _corrupt_specs(tmp_path, good):
    return rewrite(good, tmp_path / "badjson.pt2", lambda n, d: b"{not json" if n.endswith(SPECS_ENTRY) else d)


def _invalid_specs(tmp_path, good):
    return rewrite(good, tmp_path / "badwidth.pt2", specs_edit(lambda s: s.update(step_width="0:x")))


BROKEN_PACKAGES = [
    pytest.param(_missing, "does not exist", id="nonexistent"),
    pytest.param(_not_a_zip, "is not a readable .pt2 archive", id="not-a-zip"),
    pytest.param(_truncated, "is not a readable .pt2 archive", id="truncated"),
    pytest.param(_zip_not_pt2, r"is not a PT2 archive \(no archive_format entry\)", id="zip-not-pt2"),
    pytest.param(_no_specs_entry, r"has no offgraph specs \(extra/offgraph_specs.json\)", id="no-specs-entry"),
    pytest.param(_corrupt_specs, "offgraph specs entry is not valid JSON", id="corrupt-specs-json"),
    pytest.param(_invalid_specs, "(?s)invalid offgraph specs.*malformed offgraph_kv_step_width '0:x'", id="invalid-width-spec"),
]


@pytest.mark.parametrize("make,message", BROKEN_PACKAGES)
def test_broken_package_raises_artifact_error(make, message, example_artifact, tmp_path):
    path = make(tmp_path, example_artifact)
    with pytest.raises(ArtifactError, match=message) as info:
        read_artifact_specs(path)
    assert str(path) in str(info.value)  # names the package
    with pytest.raises(ArtifactError, match=message):
        Artifact.load(path)


@pytest.mark.parametrize("make,message", BROKEN_PACKAGES)
def test_cli_inspect_broken_package_exits_2(make, message, example_artifact, tmp_path):
    path = make(tmp_path, example_artifact)
    proc = cli("inspect", str(path), check=False)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr


def test_cli_check_missing_package_exits_2(tmp_path):
    proc = cli("check", str(tmp_path / "missing.pt2"), "--model", EXAMPLE, check=False)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_check_truncated_package_exits_2(example_artifact, tmp_path):
    path = _truncated(tmp_path, example_artifact)
    proc = cli("check", str(path), "--model", EXAMPLE, check=False)
    assert proc.returncode == 2 and "not a readable .pt2 archive" in proc.stderr


def test_copy_of_a_good_package_passes_the_check(example_artifact, tmp_path, example_bundle):
    """A plain file copy (not rewritten): the check only depends on the package's contents."""
    path = Path(shutil.copy(example_artifact, tmp_path / "copy.pt2"))
    assert check_artifact(path, example_bundle, decode_steps=2).passed


# -- what a check refuses to run, and infinities ------------------------------------------------


@pytest.mark.parametrize(
    "schedule, message",
    [([], "the schedule is empty"), ([4, 0], "step of 0 tokens"), ([32] * 9, "writes 288 tokens; the artifact holds at most 256")],
    ids=["empty", "zero-width-step", "past-capacity"],
)
def test_a_schedule_the_check_cannot_run_is_refused_not_reported(loaded_example, example_bundle, schedule, message):
    """An empty schedule would pass with nothing checked; one past the capacity would report a
    good artifact failing: both are refused before any step."""
    from offgraph_export.errors import OffgraphError

    with pytest.raises(OffgraphError, match=message):
        check_artifact(loaded_example, example_bundle, schedule=schedule)


def test_an_infinite_reference_does_not_make_the_comparison_unable_to_fail():
    """Where the eager output holds inf, the relative tolerance would be inf and any output pass:
    infinities must match exactly and the tolerance comes from the finite values."""
    from offgraph_export.check import StepReport, _compare_outputs

    want = torch.tensor([1.0, float("inf"), -2.0])
    for got, ok in [(want.clone(), True), (torch.tensor([1e6, float("inf"), -2.0]), False),
                    (torch.tensor([1.0, 5.0, -2.0]), False), (torch.tensor([1.0, float("-inf"), -2.0]), False),
                    (torch.tensor([1.0, float("inf"), float("nan")]), False)]:
        step = StepReport(index=0, kind="decode", start=0, width=1, width_from_spec=1, method="model")
        _compare_outputs(step, got, want, (1e-3, 1e-3))
        assert (not step.problems) == ok, (got, step.problems)


def test_a_manifest_that_disagrees_with_the_eager_model_is_named(loaded_example, example_bundle):
    """check's comparison of the manifest with what the eager model writes (heads and head dims per
    layer, and every manifest layer written at all): a manifest claiming other head counts, or a
    layer the model never writes, is reported naming the layer."""
    from offgraph_export.check import _check_manifest_model

    manifest = loaded_example.specs.manifest
    oracle = example_bundle.oracle(manifest)
    oracle.step(example_bundle.make_inputs(torch.zeros(1, 3, dtype=torch.int64), 0))
    assert _check_manifest_model(oracle, manifest) == ([], [])
    first = manifest.layers[0]
    wrong = manifest.model_copy(update={"layers": [first.model_copy(update={"kv_heads": first.kv_heads + 1}),
                                                   *manifest.layers[1:]]})
    (problem,), notes = _check_manifest_model(oracle, wrong)
    assert notes == []
    assert problem.startswith(f"layer {first.layer_id}: eager model writes (kv_heads, head_dim, v_head_dim)=")
    assert f"manifest says ({first.kv_heads + 1}, " in problem
    extra = manifest.model_copy(update={"layers": [*manifest.layers, first.model_copy(update={"layer_id": 99})]})
    oracle = example_bundle.oracle(extra)  # caches for every manifest layer; the model writes 0 and 1
    oracle.step(example_bundle.make_inputs(torch.zeros(1, 3, dtype=torch.int64), 0))
    assert _check_manifest_model(oracle, extra) == (["manifest layer 99: the eager model never wrote this layer"], [])


@pytest.mark.parametrize("kwargs", [dict(decode_steps=10**9), dict(prefill_chunks=10**9), dict(decode_steps=0)])
def test_check_refuses_unbounded_step_counts_before_any_step(loaded_example, example_bundle, kwargs):
    """A ring-only artifact bounds no schedule by its capacity: the counts themselves are bounded
    (10**9 decode steps would build a schedule of 10**9 entries)."""
    import time

    from offgraph_export.check import MAX_CHECK_STEPS

    started = time.perf_counter()
    with pytest.raises(OffgraphError, match=f"must be an int in \\[1, {MAX_CHECK_STEPS}\\]"):
        check_artifact(loaded_example, example_bundle, **kwargs)
    assert time.perf_counter() - started < 5
