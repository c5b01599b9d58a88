"""The ExecuTorch target on CPU: the stripped example lowered to a .pte, its specs read back
without loading native code, and the same check (storage manager, eager oracle, rows written)
run through ExecuTorch's own runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("executorch")

from offgraph_export.check import check_artifact  # noqa: E402
from offgraph_export.errors import ArtifactError  # noqa: E402
from offgraph_export.specs.pte import SPECS_METHOD, read_pte_constants, read_pte_specs  # noqa: E402
from offgraph_export.runtime import load_artifact  # noqa: E402
from offgraph_export.runtime.pte_artifact import PteArtifact  # noqa: E402
from offgraph_export.specs.manifest import MANIFEST_KEY  # noqa: E402
from offgraph_export.specs.step_width import STEP_WIDTH_KEY  # noqa: E402
from tests.conftest import EXAMPLE, cli  # noqa: E402


_BUILT: dict[str, Path] = {}


def example_pte_path(tmp_path_factory) -> Path:
    """The example lowered to a .pte (XNNPACK), built once per test session: an ExecuTorch export
    takes about a minute on CI, and tests/test_hostile_pte.py derives its hostile files from this
    one too. Read it, never write it."""
    if "xnnpack" not in _BUILT:
        out = tmp_path_factory.mktemp("pte") / "tiny.pte"
        cli("export", EXAMPLE, "-o", str(out), "--format", "executorch")
        _BUILT["xnnpack"] = out
    return _BUILT["xnnpack"]


@pytest.fixture(scope="module")
def example_pte(tmp_path_factory):
    return example_pte_path(tmp_path_factory)


def test_specs_travel_as_constant_methods(example_pte, example_artifact):
    constants = read_pte_constants(example_pte)
    assert constants[STEP_WIDTH_KEY] == "0:1"
    specs = read_pte_specs(example_pte)
    assert specs.manifest.to_json() == constants[MANIFEST_KEY]
    pt2 = load_artifact(example_artifact).specs
    # the same stripped program: same inputs, manifest and width as the .pt2
    assert (specs.inputs, specs.manifest, specs.step_width) == (pt2.inputs, pt2.manifest, pt2.step_width)
    assert SPECS_METHOD in constants


def test_check_passes_through_executorch_runtime(example_pte, example_bundle):
    artifact = load_artifact(example_pte)
    assert isinstance(artifact, PteArtifact)
    report = check_artifact(artifact, example_bundle)
    assert report.passed, report.render()
    assert report.growths >= 2 and report.ring_wraps == {"1": True}
    for step in report.steps:  # storage really written in place through the copy-back
        positions = list(range(step.start, step.start + step.width))
        assert step.rows_written["k_cache_0"] == positions


def test_cli_inspect_and_check_a_pte(example_pte):
    proc = cli("inspect", str(example_pte))
    assert "step width    0:1" in proc.stdout
    proc = cli("check", str(example_pte), "--model", EXAMPLE, "--steps", "4")
    assert "PASSED" in proc.stdout


def test_pte_whose_specs_disagree_with_its_constants_is_refused(example_pte, tmp_path):
    data = example_pte.read_bytes()
    tampered = data.replace(b'"max_capacity":256', b'"max_capacity":512', 1)
    assert tampered != data
    path = tmp_path / "tampered.pte"
    path.write_bytes(tampered)
    with pytest.raises(ArtifactError):
        load_artifact(path)


def test_not_a_pte_is_refused(tmp_path):
    path = tmp_path / "junk.pte"
    path.write_bytes(b"not a flatbuffer at all")
    with pytest.raises(ArtifactError, match="not a readable .pte"):
        read_pte_specs(path)


def test_every_delegate_carries_its_own_specs_read_back_from_the_program(example_pte):
    """XNNPACK delegates see their inputs in their own order: each width spec indexes the
    delegate's own arguments, and the argument it names has the width's planned extent."""
    from offgraph_export.lowering.executorch import delegate_width_specs
    from executorch.exir._serialize._program import deserialize_pte_binary

    calls = delegate_width_specs(example_pte.read_bytes())
    assert len(calls) > 4
    with_width = [(i, w, sizes) for i, w, sizes in calls if w is not None]
    assert with_width
    for _, width, sizes in with_width:
        assert sizes[width.input_index][width.dim] == 32  # max_write: the token width's bound
    # some delegate's width-carrying argument is not its first: the index is the delegate's own
    assert any(width.input_index > 0 for _, width, _ in with_width)
    program = deserialize_pte_binary(example_pte.read_bytes())
    program = getattr(program, "program", program)
    plan = next(p for p in program.execution_plan if p.name == "forward")
    manifest = read_pte_specs(example_pte).manifest.to_json().encode()
    for delegate in plan.delegates:
        keys = [s.key for s in delegate.compile_specs]
        assert keys.count(MANIFEST_KEY) == 1 and keys.count(STEP_WIDTH_KEY) <= 1  # its own list
        assert next(bytes(s.value) for s in delegate.compile_specs if s.key == MANIFEST_KEY) == manifest


def test_portable_only_pte_passes_the_check_too(tmp_path):
    """With a --max-write of 3, narrower than the example's 4 tokens: the example is cut to fit
    (it was traced at 4 tokens against a width range of [1, 3], and torch.export refused)."""
    out = tmp_path / "portable.pte"
    cli("export", EXAMPLE, "-o", str(out), "--format", "executorch", "--executorch-backend", "portable",
        "--max-write", "3")
    assert read_pte_specs(out).manifest.max_write == 3
    proc = cli("check", str(out), "--model", EXAMPLE, "--steps", "4")
    assert "PASSED" in proc.stdout


def test_split_to_slices_gives_the_cuda_backend_no_split_copy(example_bundle):
    """ExecuTorch's CUDA backend has no split_copy kernel (the fused projections' split and the
    rotary embedding's chunk lower to it): the pass that runs before that backend leaves no split
    in the stripped program, computes the same step, and the edge program holds slice_copy only."""
    from executorch.exir import EdgeCompileConfig, to_edge

    from offgraph_export.passes.split_to_slices import split_to_slices
    from offgraph_export.pipeline import export_model, run_passes

    bundle = example_bundle
    ep = export_model(bundle.model.requires_grad_(False), bundle.example_inputs, bundle.token_dims, bundle.cache_config.max_write)
    stripped = run_passes(ep, bundle.example_inputs, bundle.cache_config).stripped
    splits = [n for n in stripped.graph.nodes if "split" in str(n.target)]
    assert splits  # the fused q|k|v and gate|up projections, the rotary chunks
    args, _ = stripped.example_inputs
    want = stripped.module()(*[a.clone() for a in args])
    result = split_to_slices(stripped)
    assert result.modified and result.produced == len(splits)
    assert not any("split" in str(n.target) for n in stripped.graph.nodes)
    got = stripped.module()(*[a.clone() for a in args])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    edge = to_edge(stripped, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    ops = {str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"}
    assert not any("split" in op for op in ops) and any("slice_copy" in op for op in ops)
