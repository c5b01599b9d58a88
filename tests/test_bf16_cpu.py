"""The example exported in bfloat16 for cpu (as ``export --dtype bfloat16`` does: the bundle cast,
then ``export_and_lower``) and checked step by step against the eager bf16 model: the check passes
with the bf16 tolerance, and fails against the same model with one weight changed."""

from __future__ import annotations

import pytest
import torch

from offgraph_export.check import TOLERANCES, check_artifact
from offgraph_export.frontends import canonical_reference, load_bundle
from offgraph_export.models import cast_bundle
from offgraph_export.pipeline import export_and_lower
from offgraph_export.runtime import Artifact
from tests.conftest import EXAMPLE

pytestmark = pytest.mark.slow  # one AOTInductor compile (the fixture below)


def _bf16_bundle():
    return cast_bundle(load_bundle(EXAMPLE), "bfloat16")


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory) -> Artifact:
    """The one compile of this file: the general step only (no decode method on cpu)."""
    path = tmp_path_factory.mktemp("bf16") / "tiny_bf16.pt2"
    out, program, _ = export_and_lower(
        _bf16_bundle(), path, device="cpu", model=canonical_reference(EXAMPLE), model_args={}, model_dtype="bfloat16",
    )
    assert program.decode is None
    return Artifact.load(out)


def test_bf16_artifact_holds_bf16_weights_and_storage(bf16_artifact):
    """What the check below would not notice by itself: a program compiled in float32 would also
    pass against the bf16 model with the bf16 tolerance."""
    from offgraph_export.runtime.weights import load_method_weights
    from offgraph_export.specs.artifact import STEP_METHOD

    specs = bf16_artifact.specs
    assert specs.device == "cpu" and specs.model_dtype == "bfloat16" and specs.methods == [STEP_METHOD]
    assert specs.manifest.storage_dtype == "bfloat16"
    weights = load_method_weights(bf16_artifact.path, [STEP_METHOD], torch.device("cpu"))[STEP_METHOD]
    assert weights and {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.bfloat16}
    session = bf16_artifact.new_session()
    assert {t.dtype for t in session.storage.bound()} == {torch.bfloat16}
    session.close()


def test_bf16_cpu_artifact_passes_the_check_with_the_bf16_tolerance(bf16_artifact):
    bundle = _bf16_bundle()
    assert next(bundle.model.parameters()).dtype == torch.bfloat16
    report = check_artifact(bf16_artifact, bundle)
    assert report.passed, report.render()
    assert report.growths >= 2 and report.ring_wraps == {"1": True}
    assert len(report.steps) == len(report.schedule) and report.schedule[-16:] == [1] * 16
    atol, rtol = TOLERANCES[torch.bfloat16]
    fp32_atol, fp32_rtol = TOLERANCES[torch.float32]
    for step in report.steps:
        assert step.method == "model" and step.ok
        # the bf16 tolerance was applied: at least its atol, and (logits of a few units here) small
        # enough that the scale it implies keeps the float32 tolerance below 2e-3
        assert atol <= step.tolerance < 1.0, (step.index, step.tolerance)
        assert step.max_abs_err <= step.tolerance
    implied_fp32 = max(fp32_atol + fp32_rtol * (s.tolerance - atol) / rtol for s in report.steps)
    # and it was needed: bf16 rounding puts the compiled step beyond what float32 would allow
    assert max(s.max_abs_err for s in report.steps) > 5 * implied_fp32


def test_bf16_check_fails_against_a_model_with_one_weight_changed(bf16_artifact):
    """The comparison is live: the same check against the eager model with one element of the
    output projection changed reports output mismatches (and nothing else: the K/V are intact)."""
    bundle = _bf16_bundle()
    with torch.no_grad():
        bundle.model.output.weight[7, 0] += 4.0
    report = check_artifact(bf16_artifact, bundle)
    assert not report.passed
    failing = [s for s in report.steps if not s.ok]
    assert failing and len(report.steps) == len(report.schedule)  # every step ran; none was refused
    for step in failing:
        assert all(p.startswith("output differs from eager by") for p in step.problems), step.problems
        assert step.max_abs_err > step.tolerance


def test_the_float32_reference_is_the_second_chance_and_catches_a_wrong_model(bf16_artifact, monkeypatch):
    """With the fixed bf16 tolerance shrunk to nothing, every comparison goes to the float32
    reference (design section 6): the artifact passes by it (as close to the float32 run as the
    eager bf16 model is, within 3x), the same check without it fails, and a model with one weight
    changed fails by it too."""
    import offgraph_export.check as check

    monkeypatch.setitem(check.TOLERANCES, torch.bfloat16, (1e-7, 1e-7))
    report = check_artifact(bf16_artifact, _bf16_bundle(), decode_steps=4)
    assert report.passed, report.render()
    assert any(n.startswith("float32 reference:") for n in report.notes)
    assert all(s.by_reference and any(r.startswith("output:") for r in s.by_reference) for s in report.steps)
    assert any("rows:" in r for s in report.steps for r in s.by_reference)
    assert "~ output: over the fixed tolerance" in report.render()

    fixed_only = check_artifact(bf16_artifact, _bf16_bundle(), decode_steps=4, float32_reference=False)
    assert not fixed_only.passed and not any(s.by_reference for s in fixed_only.steps)

    bundle = _bf16_bundle()
    with torch.no_grad():
        bundle.model.output.weight[7, 0] += 4.0
    wrong = check_artifact(bf16_artifact, bundle, decode_steps=4)
    assert not wrong.passed
    assert any("against the float32 run: further" in p for s in wrong.steps for p in s.problems)


@pytest.mark.parametrize("change", ["row", "one"])
def test_a_near_tolerance_wrong_model_is_not_excused_by_the_float32_reference(bf16_artifact, change):
    """Wrong models whose error is near the fixed tolerance (review of session 20: an RMS-only rule
    passed both): the eager bf16 model meets the tolerance against float32 here (a 2-layer model
    shows no drift), so the second chance is not given and the check fails as without it."""
    bundle = _bf16_bundle()
    with torch.no_grad():
        if change == "row":
            bundle.model.output.weight[7, :] *= 1.2
        else:
            bundle.model.output.weight[7, 0] += 0.4
    report = check_artifact(bf16_artifact, bundle)
    assert not report.passed
    assert not any(s.by_reference for s in report.steps)
    assert any("no drift to allow for" in p for s in report.steps for p in s.problems)


def test_a_float32_model_gets_no_reference_unless_asked_and_then_a_clear_error(bf16_artifact):
    from offgraph_export.errors import OffgraphError

    with pytest.raises(OffgraphError, match="needs a bfloat16 or float16 model"):
        check_artifact(bf16_artifact, load_bundle(EXAMPLE), decode_steps=2, float32_reference=True)


def test_the_batched_check_gives_each_session_a_float32_reference(tmp_path, monkeypatch):
    """The same second chance in the batched check: a bf16 batched artifact (its own compile) passes
    by each session's float32 oracle with the fixed tolerance shrunk to nothing, and fails without
    it (every session's outputs compared, decode and prefill, across page boundaries)."""
    import offgraph_export.check as check
    from offgraph_export.check import check_batched
    from tests.conftest import cli

    out = tmp_path / "batched_bf16.pt2"
    cli("export", EXAMPLE, "-o", str(out), "--dtype", "bfloat16", "--max-sessions", "2", "--page-size", "4")
    monkeypatch.setitem(check.TOLERANCES, torch.bfloat16, (1e-7, 1e-7))
    report = check_batched(str(out), _bf16_bundle(), sessions=3, steps=48)
    assert report.passed, report.render()
    assert report.sessions >= 2 and report.page_crossings >= 2
    assert all(any(r.startswith("output:") for r in s.by_reference) for s in report.steps)
    assert any("rows:" in r for s in report.steps for r in s.by_reference)
    fixed_only = check_batched(str(out), _bf16_bundle(), sessions=3, steps=48, float32_reference=False)
    assert not fixed_only.passed


def test_specs_claiming_a_scheme_the_format_never_holds_are_refused(bf16_artifact, tmp_path):
    """Untrusted specs: a .pt2 whose specs claim 8da4w weights (a .pte's scheme, with a loose
    tolerance and torchao's oracle) is refused before any step, naming what a .pt2 holds."""
    from offgraph_export.check import _refuse_foreign_quantization
    from offgraph_export.errors import OffgraphError
    from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight

    q = QuantizationSpec(scheme="8da4w", group_size=32, weights=[QuantizedWeight(name="w", sources=["output.weight"], shape=[256, 64])])
    forged = bf16_artifact.specs.model_copy(update={"quantization": q})
    with pytest.raises(OffgraphError, match=r"8da4w weights, which a \.pt2 never holds \(expected one of int8, int4\)"):
        _refuse_foreign_quantization(forged, "x.pt2")
    with pytest.raises(OffgraphError, match="8da4w weights on a bfloat16 model"):
        _refuse_foreign_quantization(forged, "x.pte")
