"""``--quantize 8da4w`` for an ExecuTorch ``.pte`` (design section 11, "8da4w for .pte"): torchao's
int8 dynamic activation + int4 weight linears, delegated to XNNPACK, checked through ExecuTorch's
runtime against the eager model running torchao's own 8da4w; and every combination it does not
take refused in one line."""

from __future__ import annotations

import io

import pytest
import torch

pytest.importorskip("executorch")
pytest.importorskip("torchao")

from offgraph_export.check import QUANTIZED_TOLERANCES, check_artifact  # noqa: E402
from offgraph_export.errors import ExportError  # noqa: E402
from offgraph_export.frontends import load_bundle  # noqa: E402
from offgraph_export.options import ExportOptions, OptionError  # noqa: E402
from offgraph_export.pipeline import export_and_lower, export_model, lower, run_passes  # noqa: E402
from offgraph_export.reference.quant_8da4w import quantized_8da4w_weights, quantized_weight  # noqa: E402
from offgraph_export.runtime import load_artifact  # noqa: E402
from offgraph_export.runtime.pte_artifact import PteArtifact  # noqa: E402
from offgraph_export.specs.pte_reader import read_pte_layout  # noqa: E402
from offgraph_export.specs.quantization import QuantizationSpec  # noqa: E402
from tests.conftest import EXAMPLE, cli, first_step_logits  # noqa: E402

GROUP = 32


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The example exported once as an 8da4w .pte in groups of 32: ``(path, StrippedProgram)``
    (an ExecuTorch export costs tens of seconds here)."""
    path = tmp_path_factory.mktemp("pte8da4w") / "tiny_8da4w.pte"
    out, program, _ = export_and_lower(
        load_bundle(EXAMPLE), path, format="executorch", quantize="8da4w", group_size=GROUP, model=EXAMPLE,
    )
    return out, program


def _linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_check_passes_through_executorch_runtime(built, example_bundle):
    path, _ = built
    artifact = load_artifact(path)
    assert isinstance(artifact, PteArtifact)
    report = check_artifact(artifact, example_bundle)
    assert report.passed, report.render()
    assert report.growths >= 2 and report.ring_wraps == {"1": True}
    assert any("torchao's 8da4w" in note for note in report.notes)
    worst = max(report.steps, key=lambda s: s.max_abs_err)
    print(
        f"\n8da4w .pte vs torchao eager: max output error {worst.max_abs_err:.3e} (step {worst.index}, "
        f"tolerance {worst.tolerance:.3e}); max stored-row error {max(s.storage_max_err for s in report.steps):.3e}"
    )
    # the model was put back: float weights again
    assert all(type(w) is torch.nn.Parameter for w in _linear_weights(example_bundle.model).values())


def test_cli_inspect_and_check(built):
    path, _ = built
    proc = cli("inspect", str(path))
    assert "weights       8da4w in groups of 32: 9 linear weights from 15 model weights" in proc.stdout
    assert "quantize=8da4w, group_size=32" in proc.stdout
    proc = cli("check", str(path), "--model", EXAMPLE, "--steps", "4")
    assert "PASSED" in proc.stdout


def test_specs_record_every_linear(built, example_bundle):
    path, program = built
    spec = load_artifact(path).specs.quantization
    assert spec == program.quantization
    assert spec.scheme == "8da4w" and spec.group_size == GROUP
    # fused q|k|v and gate|up are one quantized linear each; every nn.Linear of the model is a source
    assert len(spec.weights) == 9
    assert sorted(s for w in spec.weights for s in w.sources) == sorted(_linear_weights(example_bundle.model))


def test_the_graph_holds_torchao_linears_and_no_kv_op(built):
    _, program = built
    nodes = [n for n in program.stripped.graph.nodes if n.op == "call_function"]
    targets = [str(n.target) for n in nodes]
    assert not any("update_and_attend" in t for t in targets)  # the KV op was stripped as usual
    linears = [n for n in nodes if str(n.target) == "aten.linear.default"]
    assert len(linears) == 9
    for node in linears:  # activation and weight both dequantized from torchao's int8 forms
        x, w = node.args[0], node.args[1]
        assert str(x.target) == "torchao.dequantize_affine.default"
        assert str(x.args[0].target) == "torchao.quantize_affine.default"
        assert str(w.target) == "torchao.dequantize_affine.default"
        assert w.args[2].meta["val"].dtype == torch.bfloat16  # XNNPACK's blockwise scales
        assert tuple(w.args[1]) == (1, GROUP)
    assert targets.count("torchao.choose_qparams_affine.default") == 9


def test_the_quantized_linears_are_delegated_to_xnnpack(built, example_bundle):
    """Fails if the quantization were skipped or left outside XNNPACK: no linear, matmul or
    quantization op runs outside a delegate, the delegates hold int4-sized weights, and the
    program's outputs are the 8da4w model's, far from the float model's."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    path, _ = built
    data = path.read_bytes()
    plan = next(p for p in deserialize_pte_binary(data).program.execution_plan if p.name == "forward")
    outside = sorted({op.name for op in plan.operators})
    assert not [op for op in outside if any(w in op for w in ("linear", "mm", "quant", "torchao", "choose_qparams"))], outside
    layout = read_pte_layout(io.BytesIO(data), len(data), str(path))
    assert layout.delegates and {d.backend for d in layout.delegates} == {"XnnpackBackend"}
    delegate_bytes = sum(layout.segments[d.data[1]].size for d in layout.delegates if d.data[0] == "segment")
    float_bytes = sum(w.numel() * 4 for w in _linear_weights(example_bundle.model).values())
    assert delegate_bytes < 0.3 * float_bytes, (delegate_bytes, float_bytes)  # float32 weights would not fit

    artifact = load_artifact(path)
    spec = artifact.specs.quantization
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    inputs = example_bundle.make_inputs(tokens, 0)
    got = first_step_logits(artifact, example_bundle.make_inputs, tokens)
    model = example_bundle.model
    with torch.no_grad():
        float_out = example_bundle.oracle(artifact.specs.manifest).step(inputs)[0]
        with quantized_8da4w_weights(model, spec):
            quant_out = example_bundle.oracle(artifact.specs.manifest).step(inputs)[0]
    atol, rtol = QUANTIZED_TOLERANCES["8da4w"]
    tolerance = atol + rtol * float(quant_out.abs().max())
    to_quant, to_float = float((got - quant_out).abs().max()), float((got - float_out).abs().max())
    print(f"\none 20-token prefill: |pte - 8da4w eager| {to_quant:.3e}, |pte - float eager| {to_float:.3e}, tolerance {tolerance:.3e}")
    assert to_quant <= tolerance and to_float > 2 * tolerance


def test_quality_report_runs_on_the_pte(built):
    path, _ = built
    from offgraph_export.quality import quality_report

    report = quality_report(path, EXAMPLE, tokens=32)
    assert report.weights == "8da4w/32" and report.tokens == 32
    assert report.max_logit_error > 0  # quantized: not the float model's logits


# -- the rule --------------------------------------------------------------------------------------


def test_a_fused_weight_quantizes_as_its_parts():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=gen), torch.randn(16, 64, generator=gen) * 3
    fused = quantized_weight(torch.cat([a, b]), GROUP)
    parts = [quantized_weight(a, GROUP), quantized_weight(b, GROUP)]
    for field in ("qdata", "scale", "zero_point"):
        assert torch.equal(getattr(fused, field), torch.cat([getattr(p, field) for p in parts]))
    assert fused.scale.dtype == torch.bfloat16 and int(fused.qdata.min()) >= -8 and int(fused.qdata.max()) <= 7


def test_specs_validators_are_strict():
    base = {"scheme": "8da4w", "group_size": 32, "weights": [{"name": "w", "sources": ["a.weight"], "shape": [8, 64]}]}
    assert QuantizationSpec.model_validate(base).scheme == "8da4w"
    for change, words in (
        ({"group_size": None}, "8da4w group_size None"),
        ({"group_size": 48}, "8da4w group_size 48"),
        ({"weights": [{"name": "w", "sources": ["a"], "shape": [8, 80]}]}, "80 input features, not a multiple of the 8da4w group size 32"),
        ({"scheme": "int8"}, "applies to int4 and 8da4w weights only; this spec has none"),
        ({"weights": [{"name": "w", "sources": ["a"], "shape": [8, 64], "scheme": "int8"}]}, "a 8da4w spec stores every weight as 8da4w"),
        ({"scheme": "8da8w"}, "scheme"),
    ):
        with pytest.raises(ValueError, match=words):
            QuantizationSpec.model_validate(base | change)


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, flag, words",
    [
        (dict(quantize="8da4w"), "--quantize", "--quantize 8da4w (int8 dynamic activations, int4 weights) is lowered by ExecuTorch's XNNPACK for a .pte; a .pt2 takes --quantize int8 or int4"),
        (dict(quantize="int8", format="executorch"), "--quantize", "--quantize int8 is weight-only quantization for a .pt2: ExecuTorch's XNNPACK computed weight-only int4 and int8 programs wrongly (outputs 130x and 2000x off), so a .pte takes --quantize 8da4w"),
        (dict(quantize="int4", format="executorch"), "--quantize", "--quantize int4 is weight-only"),
        (dict(quantize="8da4w", format="executorch", executorch_backend="portable"), "--executorch-backend", "the portable backend has none"),
        (dict(quantize="8da4w", format="executorch", group_size=48), "--group-size", "--group-size 48 is not one of 32, 64, 128"),
    ],
)
def test_options_refuse_in_one_line(fields, flag, words):
    with pytest.raises(OptionError) as info:
        ExportOptions.parse(**fields).resolve(32)
    assert info.value.flag == flag and words in str(info.value) and "\n" not in str(info.value)


def test_options_take_8da4w_for_a_float32_pte_only():
    resolved = ExportOptions.parse(format="executorch", quantize="8da4w").resolve(32, dtype="float32")
    assert resolved.record() == {"fuse_projections": True, "quantize": "8da4w", "group_size": 128}
    with pytest.raises(OptionError, match="--quantize 8da4w takes a float32 model, not --dtype bfloat16") as info:
        ExportOptions.parse(format="executorch", quantize="8da4w").resolve(32, dtype="bfloat16")
    assert "\n" not in str(info.value)


def test_cli_refuses_before_building_anything(tmp_path):
    for extra, words in (
        (["--format", "executorch", "--dtype", "bfloat16"], "takes a float32 model, not --dtype bfloat16"),
        ([], "a .pt2 takes --quantize int8 or int4"),
    ):
        out = tmp_path / ("m.pte" if extra else "m.pt2")
        proc = cli("export", EXAMPLE, "-o", str(out), "--quantize", "8da4w", *extra, check=False)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not out.exists()


def test_export_refuses_a_group_size_or_dtype_the_weights_do_not_take(tmp_path):
    with pytest.raises(ExportError, match=r"has 64 input features, not a multiple of the 8da4w group size 128; use --group-size 32 or 64") as info:
        export_and_lower(load_bundle(EXAMPLE), tmp_path / "m.pte", format="executorch", quantize="8da4w", group_size=128)
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match=r"8da4w takes float32 \[N, K\] weights; .* is torch.bfloat16") as info:
        export_and_lower(load_bundle(EXAMPLE, dtype="bfloat16"), tmp_path / "m.pte", format="executorch", quantize="8da4w", group_size=32)
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


def test_lowering_refuses_a_weight_only_program_as_a_pte(tmp_path):
    """The API path (run_passes, then lower) meets the same rule as the CLI."""
    bundle = load_bundle(EXAMPLE)
    inputs = tuple(x[..., :8] for x in bundle.example_inputs)
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, quantize="int4", group_size=32)
    with pytest.raises(OptionError, match="--quantize int4 is weight-only quantization for a .pt2"):
        lower(program, tmp_path / "m.pte", format="executorch")
    assert not list(tmp_path.iterdir())
