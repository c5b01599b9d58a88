"""Models a user already quantized with torchao's weight-only configs (docs/design.md section 11,
"Models quantized with torchao"): each accepted torchao tensor converts to the stored form without
changing a value (torchao's own ``dequantize()`` is the oracle, compared bit for bit), the program
stores exactly torchao's integers and scales, every form that does not map is refused in one line,
and two artifacts compiled for the cpu pass ``check`` against the eager torchao model itself:
int8 through the CLI (a factory returning a torchao model), int4 through the Python API with one
linear left float by torchao and quantized by ``--quantize int4``. The project imports and exports
without torchao."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.models import ModelBundle
from tests.conftest import EXAMPLE, ROOT, cli, first_step_logits

INT8_FACTORY = f"{Path(__file__).resolve()}:build_int8"

#: every linear of the example (2 layers x wq, wk, wv, wo, w1, w3, w2, and the output projection)
N_LINEARS = 15


def _torchao():
    return pytest.importorskip("torchao.quantization")


def _example(**kwargs) -> ModelBundle:
    from offgraph_export.frontends import load_bundle

    return load_bundle(EXAMPLE, **kwargs)


def build_int8(**kwargs) -> ModelBundle:
    """The example with every linear quantized by torchao's ``Int8WeightOnlyConfig`` (a factory
    the CLI and ``check`` name by this file's path)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    bundle = _example(**kwargs)
    quantize_(bundle.model, Int8WeightOnlyConfig(set_inductor_config=False))
    return bundle


def _int4_bundle(group: int = 32, dtype: str = "float32", skip: tuple[str, ...] = ("output",)) -> ModelBundle:
    """The example with torchao's symmetric int4 (``IntxWeightOnlyConfig``, groups of ``group``)
    on every linear but those named in ``skip``."""
    ao = _torchao()
    from torchao.quantization.granularity import PerGroup

    bundle = _example(dtype=dtype)
    ao.quantize_(
        bundle.model, ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group)),
        filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn not in skip,
    )
    return bundle


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _one_line_refusal(exc: BaseException, *words: str) -> None:
    text = str(exc)
    assert "\n" not in text, text
    for word in words:
        assert word in text, (word, text)


# -- the conversion, against torchao's own dequantize() -------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weight_only_converts_to_the_stored_form_exactly(dtype):
    """``Int8WeightOnlyConfig``: the stored ``qweight`` is torchao's ``qdata`` (its -128 included),
    the scales its per-row scales in the model's dtype, and the dequantized weight is torchao's bit
    for bit."""
    ao = _torchao()
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights
    from offgraph_export.reference.weight_quant import dequantize

    bundle = _example(dtype=dtype)
    ao.quantize_(bundle.model, ao.Int8WeightOnlyConfig(set_inductor_config=False))
    found = convert_torchao_weights(bundle.model)
    assert found is not None and found.scheme == "int8" and found.group_size is None
    assert len(found.stored) == N_LINEARS
    params = dict(bundle.model.named_parameters())
    for name, stored in found.stored.items():
        theirs = params[name]
        assert type(theirs).__name__ == "Int8Tensor"
        assert stored.qweight.dtype == torch.int8 and torch.equal(stored.qweight, theirs.qdata)
        assert stored.scales.dtype == getattr(torch, dtype) and stored.scales.shape == (theirs.shape[0],)
        assert torch.equal(stored.scales.float(), theirs.scale.flatten())
        assert torch.equal(_bits(dequantize(stored)), _bits(theirs.dequantize()))
    assert any(int(s.qweight.min()) == -128 for s in found.stored.values())  # torchao's range, kept


@pytest.mark.parametrize("dtype,group", [("float32", 32), ("bfloat16", 64)])
def test_intx_int4_converts_to_nibbles_scales_and_zero_zeros_exactly(dtype, group):
    """``IntxWeightOnlyConfig(int4, PerGroup)``: the nibbles (unpacked here independently: low
    nibble = even k) are torchao's ``qdata + 8``, the scales its group scales, the zeros 0, and
    the dequantized weight is torchao's bit for bit."""
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights
    from offgraph_export.reference.weight_quant import dequantize

    bundle = _int4_bundle(group, dtype, skip=())
    found = convert_torchao_weights(bundle.model)
    assert found is not None and (found.scheme, found.group_size) == ("int4", group)
    assert len(found.stored) == N_LINEARS
    params = dict(bundle.model.named_parameters())
    for name, stored in found.stored.items():
        theirs = params[name]
        n, k = theirs.shape
        nibbles = torch.empty(n, k, dtype=torch.int16)
        nibbles[:, 0::2] = (stored.qweight & 0x0F).to(torch.int16)
        nibbles[:, 1::2] = (stored.qweight >> 4).to(torch.int16)
        assert torch.equal(nibbles - 8, theirs.qdata.to(torch.int16))
        assert torch.equal(stored.scales, theirs.scale) and stored.scales.shape == (n, k // group)
        assert stored.zeros is not None and not bool(stored.zeros.ne(0).any())
        assert torch.equal(_bits(dequantize(stored)), _bits(theirs.dequantize()))


def test_intx_int8_per_row_converts_exactly():
    ao = _torchao()
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights
    from offgraph_export.reference.weight_quant import dequantize

    bundle = _example(dtype="bfloat16")
    ao.quantize_(bundle.model, ao.IntxWeightOnlyConfig(weight_dtype=torch.int8))
    found = convert_torchao_weights(bundle.model)
    assert found is not None and found.scheme == "int8" and len(found.stored) == N_LINEARS
    params = dict(bundle.model.named_parameters())
    for name, stored in found.stored.items():
        assert torch.equal(stored.qweight, params[name].qdata)
        assert torch.equal(_bits(dequantize(stored)), _bits(params[name].dequantize()))


def test_a_model_without_torchao_tensors_converts_to_nothing():
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights

    assert convert_torchao_weights(_example().model) is None


# -- refusals ---------------------------------------------------------------------------------------


def _one_linear(dtype=torch.float32, k: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(k, 32, bias=False)).to(dtype)


def _refusal_cases():
    ao = _torchao()
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    int4 = dict(weight_dtype=torch.int4, granularity=PerGroup(32))
    return [
        (ao.Int8WeightOnlyConfig(granularity=PerGroup(32), set_inductor_config=False), "Int8Tensor", "blocks of [1, 32]"),
        (ao.IntxWeightOnlyConfig(**int4, mapping_type=MappingType.ASYMMETRIC), "IntxUnpackedToInt8Tensor", "zero points are not 0"),
        (ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)), "IntxUnpackedToInt8Tensor", "blocks of [1, 16]"),
        (ao.IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(32)), "IntxUnpackedToInt8Tensor", "int2 weights"),
        (ao.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False), "Int8DynamicActivationInt8WeightConfig", "activations are quantized"),
        (ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
         "Int8DynamicActivationIntxWeightConfig", "activations are quantized"),
    ]


def test_forms_that_do_not_map_exactly_are_refused_in_one_line():
    """Another granularity, a non-zero zero point, another bit width, activation quantization:
    each refused naming the weight, torchao's class or config, and what is accepted."""
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights

    ao = _torchao()
    for config, kind, why in _refusal_cases():
        model = _one_linear()
        ao.quantize_(model, config)
        with pytest.raises(ExportError) as info:
            convert_torchao_weights(model)
        _one_line_refusal(info.value, "0.weight", kind, why, "accepted are", "IntxWeightOnlyConfig")


def test_int4_weight_only_packings_and_inexact_scales_are_refused():
    """``Int4WeightOnlyConfig``'s packings cannot be built on a CPU torch (each needs a CUDA, mslk
    or XPU kernel), so one is made by hand; an int8 scale the model's dtype does not hold is
    refused rather than rounded."""
    ao = _torchao()
    from torchao.quantization.quantize_.workflows.int4.int4_tensor import Int4Tensor
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    from offgraph_export.frontends.torchao_weights import convert_torchao_weights

    with pytest.raises(ImportError, match="mslk"):  # torchao 0.18's default (plain) packing on a CPU torch
        ao.quantize_(_one_linear(torch.bfloat16), ao.Int4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    model = _one_linear(torch.bfloat16)
    packed = Int4Tensor(torch.zeros(32, 32, dtype=torch.uint8), torch.ones(2, 32, dtype=torch.bfloat16),
                        torch.zeros(2, 32, dtype=torch.bfloat16), [1, 32], torch.Size([32, 64]))
    model[0].weight = torch.nn.Parameter(packed, requires_grad=False)
    with pytest.raises(ExportError) as info:
        convert_torchao_weights(model)
    _one_line_refusal(info.value, "0.weight", "Int4Tensor", "Int4WeightOnlyConfig(int4_packing_format='plain')", "accepted are")

    model = _one_linear(torch.bfloat16)
    ao.quantize_(model, ao.Int8WeightOnlyConfig(set_inductor_config=False))
    w = model[0].weight
    off = w.scale * (1 + 2.0 ** -12)  # float32 values between two bfloat16 ones
    model[0].weight = torch.nn.Parameter(Int8Tensor(w.qdata, off, w.block_size, w.dtype, zero_point=w.zero_point), requires_grad=False)
    with pytest.raises(ExportError) as info:
        convert_torchao_weights(model)
    _one_line_refusal(info.value, "0.weight", "Int8Tensor", "float32 scales are not all exact in bfloat16")


def test_a_torchao_weight_outside_a_linear_and_mixed_schemes_are_refused():
    ao = _torchao()
    from torchao.quantization.granularity import PerAxis, PerGroup

    from offgraph_export.frontends.torchao_weights import convert_torchao_weights

    bundle = _example()
    ao.quantize_(bundle.model, ao.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
                 filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))
    with pytest.raises(ExportError) as info:
        convert_torchao_weights(bundle.model)
    _one_line_refusal(info.value, "tok_embeddings.weight", "not an nn.Linear's weight")

    bundle = _example()
    ao.quantize_(bundle.model, ao.Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda m, fqn: fqn == "output")
    ao.quantize_(bundle.model, ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                 filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "output")
    with pytest.raises(ExportError) as info:
        convert_torchao_weights(bundle.model)
    _one_line_refusal(info.value, "one scheme", "int4 in groups of 32", "output.weight")

    model = build_int8().model.to(torch.bfloat16)  # casts the float weights, not torchao's Int8Tensor
    with pytest.raises(ExportError) as info:
        convert_torchao_weights(model)
    _one_line_refusal(info.value, "layers.0.attention.wq.weight", "Int8Tensor", "computes in float32", "bfloat16", "before quantize_")


def test_options_that_do_not_go_with_a_torchao_model_are_refused(tmp_path):
    """Another ``--quantize`` scheme, another int4 group size, a ``.pte``: refused before
    anything is traced (the Python API), and through the CLI in one line on stderr."""
    from offgraph_export.options import OptionError
    from offgraph_export.pipeline import export_and_lower

    bundle = _int4_bundle(32)
    for fields, flag, words in (
        (dict(quantize="int8"), "--quantize", "use --quantize int4"),
        (dict(quantize="int4", group_size=64), "--group-size", "use --group-size 32"),
        (dict(format="executorch"), "--format", "a .pte takes no weight-only"),
    ):
        with pytest.raises(OptionError) as info:
            export_and_lower(bundle, tmp_path / ("m.pte" if "format" in fields else "m.pt2"), **fields)
        assert info.value.flag == flag
        _one_line_refusal(info.value, "layers.0.attention.wq.weight", "IntxUnpackedToInt8Tensor", words)
    assert not list(tmp_path.iterdir())
    proc = cli("export", INT8_FACTORY, "-o", str(tmp_path / "x.pt2"), "--quantize", "int4", check=False)
    assert proc.returncode == 2 and not (tmp_path / "x.pt2").exists()
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "--quantize int4" in error and "Int8Tensor" in error and "use --quantize int8" in error, proc.stderr
    assert "exporting" not in proc.stderr  # refused before anything was traced


# -- the program stores torchao's tensors -----------------------------------------------------------


def test_fused_projections_store_torchaos_integers_and_scales_joined():
    """Through ``export_and_lower``'s stages: the program's stored constants are torchao's
    ``qdata`` and scales (a fused q|k|v or gate|up weight: its parts' rows joined), the spec
    records them as ``--quantize int8`` would, no float copy of a linear weight is left, and the
    user's model holds its torchao tensors again afterwards."""
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights, float_stand_ins
    from offgraph_export.pipeline import export_model, run_passes

    bundle = build_int8()
    found = convert_torchao_weights(bundle.model)
    assert found is not None
    with pytest.raises(ExportError, match="export_model traces float weights"):
        export_model(bundle.model, bundle.example_inputs, bundle.token_dims, 16)
    with float_stand_ins(bundle.model, found):
        assert not any(type(p).__name__ == "Int8Tensor" for p in bundle.model.parameters())
        ep = export_model(bundle.model, bundle.example_inputs, bundle.token_dims, 16)
    params = dict(bundle.model.named_parameters())
    assert all(type(params[name]).__name__ == "Int8Tensor" for name in found.stored)  # put back
    program = run_passes(ep, bundle.example_inputs, bundle.cache_config, quantize="int8", stored=found.stored,
                         quantize_others=False)
    spec = program.quantization
    assert spec is not None and spec.scheme == "int8" and spec.group_size is None
    assert len(spec.weights) == 9 and sum(len(w.sources) for w in spec.weights) == N_LINEARS
    assert program.options["quantize"] == "int8"
    state = program.pass_results["quantize_weights"].program.state_dict
    assert any(len(w.sources) == 3 for w in spec.weights)
    for index, entry in enumerate(spec.weights):
        assert torch.equal(state[f"offgraph_quant_{index}.qweight"], torch.cat([params[s].qdata for s in entry.sources]))
        assert torch.equal(state[f"offgraph_quant_{index}.scales"], torch.cat([params[s].scale.flatten() for s in entry.sources]))
    floats = {n for n, v in state.items() if v.is_floating_point() and v.dim() == 2}
    assert floats == {"tok_embeddings.weight"}


def test_a_fused_projection_of_torchao_and_float_parts_is_refused():
    """q quantized by torchao, k and v not: fusing them would store one weight partly float or
    quantize torchao's values again; refused naming both, and without fusion it exports."""
    ao = _torchao()
    from offgraph_export.frontends.torchao_weights import convert_torchao_weights, float_stand_ins
    from offgraph_export.pipeline import export_model, run_passes

    bundle = _example()
    ao.quantize_(bundle.model, ao.Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda m, fqn: fqn.endswith("wq"))
    found = convert_torchao_weights(bundle.model)
    assert found is not None and len(found.stored) == 2
    with float_stand_ins(bundle.model, found):
        ep = export_model(bundle.model, bundle.example_inputs, bundle.token_dims, 16)
    with pytest.raises(ExportError) as info:
        run_passes(ep, bundle.example_inputs, bundle.cache_config, quantize="int8", stored=found.stored, quantize_others=False)
    _one_line_refusal(info.value, "layers.0.attention.wq.weight arrived quantized", "--no-fuse-projections")
    program = run_passes(ep, bundle.example_inputs, bundle.cache_config, fuse=False, quantize="int8", stored=found.stored,
                         quantize_others=False)
    assert sorted(s for w in program.quantization.weights for s in w.sources) == sorted(found.stored)


# -- compiled and checked against the torchao model (cpu) -------------------------------------------


@pytest.fixture(scope="module")
def int8_artifact(tmp_path_factory):
    """The int8 torchao example exported for the cpu through the CLI (one AOTInductor compile)."""
    _torchao()

    out = tmp_path_factory.mktemp("torchao") / "int8.pt2"
    cli("export", INT8_FACTORY, "-o", str(out), "--json")
    return out


def test_int8_torchao_artifact_checks_against_the_torchao_model(int8_artifact):
    """``check`` passes with the torchao model as its oracle (its weights left as torchao tensors,
    nothing dequantized by the rule); the specs record int8 as ``--quantize int8`` would."""
    from offgraph_export.check import check_artifact

    report = check_artifact(str(int8_artifact), INT8_FACTORY)
    assert report.passed, report.render()
    assert any("9 torchao-quantized weights as torchao computes them" in n for n in report.notes), report.notes
    assert not any("weights dequantized" in n for n in report.notes), report.notes
    specs = json.loads(cli("inspect", str(int8_artifact), "--json").stdout)
    assert specs["options"]["quantize"] == "int8" and specs["quantization"]["scheme"] == "int8"
    assert sum(len(w["sources"]) for w in specs["quantization"]["weights"]) == N_LINEARS


def test_int8_torchao_artifact_logits_are_the_torchao_models_not_the_float_ones(int8_artifact):
    """The artifact's logits against the eager torchao model within check's float32 tolerance,
    and further than that from the float model the example was quantized from: the oracle is not
    vacuous."""
    from offgraph_export.check import TOLERANCES
    from offgraph_export.runtime import load_artifact

    program = load_artifact(str(int8_artifact))
    torchao_bundle, float_bundle = build_int8(), _example()
    tokens = torch.randint(0, float_bundle.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    got = first_step_logits(program, float_bundle.make_inputs, tokens)
    inputs = tuple(float_bundle.make_inputs(tokens, 0))
    with torch.no_grad():
        want = torchao_bundle.oracle(program.specs.manifest).step(inputs)[0]
        want_float = float_bundle.oracle(program.specs.manifest).step(inputs)[0]
    atol, rtol = TOLERANCES[torch.float32]
    assert torch.allclose(got, want, atol=atol, rtol=rtol), (got - want).abs().max()
    assert (got - want_float).abs().max() > 10 * (atol + rtol * want_float.abs().max())


def test_int4_torchao_model_with_a_float_linear_and_quantize_int4_checks(tmp_path_factory):
    """The Python API: torchao int4 (groups of 32) on every linear but the output projection, and
    ``quantize="int4"`` with no group size: the torchao weights are stored as they are, the output
    projection quantized by the rule in torchao's group size, and ``check`` passes with an oracle
    that runs the torchao linears as torchao does and dequantizes the output projection."""
    from offgraph_export.check import check_artifact
    from offgraph_export.pipeline import export_and_lower

    bundle = _int4_bundle(32)
    out = tmp_path_factory.mktemp("torchao") / "int4.pt2"
    path, program, _ = export_and_lower(bundle, out, quantize="int4")
    spec = program.quantization
    assert spec is not None and (spec.scheme, spec.group_size) == ("int4", 32) and len(spec.weights) == 9
    assert program.options["group_size"] == 32
    assert type(bundle.model.layers[0].attention.wq.weight).__name__ == "IntxUnpackedToInt8Tensor"
    report = check_artifact(str(path), bundle)
    assert report.passed, report.render()
    assert any("8 torchao-quantized weights" in n for n in report.notes), report.notes
    assert any("int4 weights dequantized (1 quantized weights, 1 model weights, groups of 32)" in n for n in report.notes), report.notes


def test_int8_torchao_model_with_an_int4_lm_head_checks_and_a_quantized_lm_head_keeps_its_scheme(tmp_path_factory):
    """torchao int8 on every linear but the output projection, ``quantize="int8"`` with
    ``quantize_lm_head="int4"``: the export takes the lm_head's group size (128 by default: the
    example's output projection reads 64 features, so 64 here) though the torchao weights have none,
    and ``check`` passes against the torchao model with the lm_head dequantized from int4. A
    torchao model whose lm_head is quantized too keeps its int8: another lm_head scheme is refused."""
    ao = _torchao()
    from offgraph_export.check import check_artifact
    from offgraph_export.pipeline import export_and_lower

    base = tmp_path_factory.mktemp("torchao_head")
    bundle = _example()
    ao.quantize_(bundle.model, ao.Int8WeightOnlyConfig(set_inductor_config=False),
                 filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "output")
    path, program, _ = export_and_lower(bundle, base / "int8_head4.pt2", quantize="int8", quantize_lm_head="int4", group_size=64)
    spec = program.quantization
    assert spec is not None and (spec.scheme, spec.group_size) == ("int8", 64) and spec.label() == "int8+lm_head:int4/64"
    assert [w.name for w in spec.weights if w.scheme == "int4"] == ["output.weight"]
    report = check_artifact(str(path), bundle)
    assert report.passed, report.render()
    assert any("int8+lm_head:int4 weights dequantized (1 quantized weights, 1 model weights, groups of 64)" in n
               for n in report.notes), report.notes

    every = build_int8()
    with pytest.raises(ExportError, match="output.weight arrived quantized as int8, but this export stores int4"):
        export_and_lower(every, base / "refused.pt2", quantize="int8", quantize_lm_head="int4", group_size=64)
    assert not (base / "refused.pt2").exists()


# -- without torchao --------------------------------------------------------------------------------


def test_the_project_exports_and_checks_without_torchao(tmp_path):
    """With torchao made unimportable, the pipeline, check and the conversion module import, a
    float model converts to nothing and its export runs through the passes: nothing reaches for
    torchao unless a model holds its tensors."""
    script = f"""
import sys
sys.modules["torchao"] = None  # import torchao now raises ImportError
from offgraph_export.frontends import load_bundle
from offgraph_export.frontends.torchao_weights import convert_torchao_weights
from offgraph_export.pipeline import export_model, run_passes
import offgraph_export.check
bundle = load_bundle({EXAMPLE!r})
assert convert_torchao_weights(bundle.model) is None
ep = export_model(bundle.model, bundle.example_inputs, bundle.token_dims, 16)
program = run_passes(ep, bundle.example_inputs, bundle.cache_config, quantize="int8")
assert program.quantization.scheme == "int8"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_spec_weight_of_torchao_and_float_parts_is_refused_by_the_oracle():
    """``check``'s oracle cannot quantize a torchao weight again: a recorded weight made of a
    torchao part and a float part is refused by name."""
    ao = _torchao()
    from offgraph_export.frontends.torchao_weights import oracle_split
    from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight

    bundle = _example()
    ao.quantize_(bundle.model, ao.Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda m, fqn: fqn.endswith("wq"))
    q, k = "layers.0.attention.wq.weight", "layers.0.attention.wk.weight"
    spec = QuantizationSpec(scheme="int8", weights=[
        QuantizedWeight(name="fused", sources=[q, k], shape=[96, 64]),
        QuantizedWeight(name="output.weight", sources=["output.weight"], shape=[256, 64]),
    ])
    with pytest.raises(OffgraphError, match=f"holds {q} as torchao tensors but {k} as float"):
        oracle_split(bundle.model, spec)
    kept, rest = oracle_split(bundle.model, spec.model_copy(update={"weights": spec.weights[1:]}))
    assert kept == 0 and rest is not None and [w.name for w in rest.weights] == ["output.weight"]
