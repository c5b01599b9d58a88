"""Weight-only int8 / int4 (docs/design.md section 11): the formats against a plain recompute, the
specs' record and the options' rules, the pass on the example's program (every linear's weight
stored quantized, the program computing what the eager model with dequantized weights computes, a
tied table kept float for its embedding), and quantized artifacts compiled for the cpu and checked
against their dequantized oracle: the example (int8), the example batched (int4), a transformers
Qwen2 with biases, sliding-window layers and tied embeddings (int4)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from offgraph_export.errors import ExportError, OffgraphError, SpecError
from offgraph_export.options import ExportOptions, OptionError
from offgraph_export.reference.weight_quant import dequantize, dequantize_graph, dequantized_weights, quantize
from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight
from tests.conftest import EXAMPLE, cli

# -- the formats ----------------------------------------------------------------------------------


def _weight(n: int = 24, k: int = 64, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)


def test_int8_is_symmetric_per_output_channel():
    w = _weight()
    w[3] = 0.0  # a zero row: no division by zero, dequantizes to zeros
    q = quantize(w, "int8")
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == w.shape and q.scales.shape == (w.shape[0],)
    assert int(q.qweight.abs().max()) <= 127
    # the plain rule, written out: scale = amax / 127, q = round(w / scale)
    scales = w.abs().amax(dim=1) / 127
    for n in (0, 5, 23):
        assert torch.equal(q.qweight[n], torch.round(w[n] / scales[n]).to(torch.int8))
    back = dequantize(q)
    assert torch.equal(back[3], torch.zeros(w.shape[1]))
    # each value within half a step of its row's scale
    assert bool(((back - w).abs() <= scales[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("group", [32, 64])
def test_int4_packs_two_nibbles_a_byte_with_group_scales_and_zeros(group):
    w = _weight(k=128, seed=1)
    q = quantize(w, "int4", group)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (24, 64)
    assert q.scales.shape == q.zeros.shape == (24, 128 // group)
    # independent recompute of the layout: q[n, k] is the low nibble of byte k // 2 when k is even
    nibbles = torch.empty(24, 128, dtype=torch.int64)
    nibbles[:, 0::2] = (q.qweight & 0x0F).long()
    nibbles[:, 1::2] = (q.qweight >> 4).long()
    g = w.reshape(24, -1, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = (hi - lo) / 15
    want = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(24, 128).long()
    assert torch.equal(nibbles, want)
    assert torch.allclose(q.zeros, lo + 8 * scale)
    # dequantized: (q - 8) * scale + zero, each value within half a step of its group's scale
    back = dequantize(q)
    plain = ((nibbles.float() - 8).reshape(24, -1, group) * q.scales[..., None] + q.zeros[..., None]).reshape(24, 128)
    assert torch.equal(back, plain)
    assert bool(((back - w).abs().reshape(24, -1, group) <= scale[..., None] / 2 + 1e-6).all())


def test_bf16_weights_keep_their_dtype_and_the_rule_is_deterministic():
    w = _weight(dtype=torch.bfloat16)
    for scheme, group in (("int8", None), ("int4", 32)):
        a, b = quantize(w, scheme, group), quantize(w.clone(), scheme, group)
        assert a.scales.dtype == torch.bfloat16 and dequantize(a).dtype == torch.bfloat16
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
        graph = dequantize_graph(a.qweight, a.scales, a.zeros, a.group_size, torch.bfloat16)
        assert torch.equal(graph, dequantize(a))


def test_int4_refuses_a_width_the_group_does_not_divide_naming_what_would():
    with pytest.raises(OffgraphError, match=r"proj.weight has 96 input features.*group size 64; use --group-size 32"):
        quantize(_weight(k=96), "int4", 64, name="proj.weight")
    with pytest.raises(OffgraphError, match="2-D floating"):
        quantize(torch.zeros(4, 4, dtype=torch.int32), "int8")


# -- the record and the options -------------------------------------------------------------------


def _spec(**fields) -> dict:
    base = {"scheme": "int4", "group_size": 32,
            "weights": [{"name": "w", "sources": ["a.weight", "b.weight"], "shape": [8, 64]}]}
    return base | fields


def test_the_record_refuses_what_no_export_writes():
    assert QuantizationSpec.model_validate(_spec()).weights[0].sources == ["a.weight", "b.weight"]
    bad = [
        (_spec(group_size=None), "group_size None"),
        (_spec(group_size=48), "group_size 48"),
        (_spec(scheme="int8"), "applies to int4 and 8da4w weights only; this spec has none"),
        (_spec(weights=[{"name": "w", "sources": ["a"], "shape": [8, 64], "scheme": "int8"}]), "this spec has none"),
        (_spec(scheme="int8", group_size=None, weights=[{"name": "w", "sources": ["a"], "shape": [8, 64], "scheme": "int4"}]),
         "int4 group_size None"),
        (_spec(weights=[{"name": "w", "sources": ["a"], "shape": [8, 64], "scheme": "8da4w"}]), "scheme"),
        (_spec(weights=[{"name": "w", "sources": ["a"], "shape": [8, 40]}]), "40 input features"),
        (_spec(weights=[{"name": "w", "sources": ["a"], "shape": [8, 64]}, {"name": "w", "sources": ["b"], "shape": [8, 64]}]), "named twice"),
        (_spec(weights=[]), "at least 1"),
        (_spec(weights=[{"name": "w", "sources": [], "shape": [8, 64]}]), "at least 1"),
    ]
    for data, words in bad:
        with pytest.raises(ValueError, match=words):
            QuantizationSpec.model_validate(data)


def test_a_weight_may_name_its_own_scheme():
    """The lm_head of ``--quantize-lm-head``: an int8 weight in an int4 spec needs no group; an
    int4 weight in an int8 spec takes the spec's group size."""
    mixed = QuantizationSpec.model_validate(_spec(weights=[
        {"name": "w", "sources": ["a"], "shape": [8, 64]},
        {"name": "head", "sources": ["h"], "shape": [8, 40], "scheme": "int8"},
    ]))
    assert [(mixed.scheme_of(w), mixed.group_of(w)) for w in mixed.weights] == [("int4", 32), ("int8", None)]
    other = QuantizationSpec.model_validate(_spec(scheme="int8", weights=[
        {"name": "w", "sources": ["a"], "shape": [8, 40]},
        {"name": "head", "sources": ["h"], "shape": [8, 64], "scheme": "int4"},
    ]))
    assert [(other.scheme_of(w), other.group_of(w)) for w in other.weights] == [("int8", None), ("int4", 32)]
    assert QuantizationSpec.model_validate_json(other.model_dump_json()) == other


def test_options_record_the_scheme_and_refuse_what_does_not_go_together():
    assert ExportOptions.parse(quantize="int4").resolve(32).record()["group_size"] == 128
    assert "group_size" not in ExportOptions.parse(quantize="int8").resolve(32).record()
    assert "quantize" not in ExportOptions.parse().resolve(32).record()
    # the lm_head's own scheme: recorded where it differs; an int4 lm_head brings the group size
    assert ExportOptions.parse(quantize="int4", quantize_lm_head="int8").resolve(32).record()["quantize_lm_head"] == "int8"
    assert "quantize_lm_head" not in ExportOptions.parse(quantize="int4", quantize_lm_head="int4").resolve(32).record()
    head_int4 = ExportOptions.parse(quantize="int8", quantize_lm_head="int4", group_size=64).resolve(32)
    assert (head_int4.group_size, head_int4.quantize_lm_head) == (64, "int4")
    assert ExportOptions.parse(quantize="int8", quantize_lm_head="int4").resolve(32).group_size == 128
    for fields, flag in ((dict(quantize="int8", group_size=32), "--group-size"), (dict(quantize="int4", group_size=100), "--group-size"),
                         (dict(quantize="int4", format="executorch"), "--quantize"),
                         (dict(quantize_lm_head="int8"), "--quantize-lm-head"),
                         (dict(quantize="int8", quantize_lm_head="none", group_size=32), "--group-size"),
                         (dict(quantize_lm_head="int3"), "--quantize-lm-head")):
        with pytest.raises(OptionError) as info:
            ExportOptions.parse(**fields).resolve(32)
        assert info.value.flag == flag


def test_cli_refuses_quantizing_a_pte_before_building_anything(tmp_path):
    proc = cli("export", EXAMPLE, "-o", str(tmp_path / "m.pte"), "--format", "executorch", "--quantize", "int8", check=False)
    assert proc.returncode == 2 and "--quantize" in proc.stderr and "XNNPACK" in proc.stderr
    assert not (tmp_path / "m.pte").exists()


# -- the pass -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_program():
    from offgraph_export.frontends import load_bundle
    from offgraph_export.passes.fuse_projections import fuse_projections
    from offgraph_export.pipeline import _fused_sources, export_model

    bundle = load_bundle(EXAMPLE)
    ep = export_model(bundle.model, bundle.example_inputs, bundle.token_dims, 16)
    fused = fuse_projections(ep, bundle.example_inputs)
    return bundle, fused.program, _fused_sources(fused)


def _run(module: torch.nn.Module, bundle, tokens: torch.Tensor) -> torch.Tensor:
    """One prefill step from empty reference caches (the neutral op's eager semantics)."""
    from offgraph_export.reference.cache import ReferenceCaches

    caches = ReferenceCaches(bundle.cache_config, [0, 1])
    with torch.no_grad(), caches.activate():
        return module(*bundle.make_inputs(tokens, 0))


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32)])
def test_pass_stores_every_linear_quantized_and_computes_the_dequantized_model(example_program, scheme, group):
    from offgraph_export.passes.quantize_weights import quantize_weights

    bundle, program, sources = example_program
    result = quantize_weights(program, bundle.example_inputs, scheme, group, sources)
    spec = result.produced
    assert result.modified and spec.scheme == scheme and spec.group_size == group
    # every linear of the example: 2 layers x (q|k|v, o, gate|up, down) + the output projection
    assert len(spec.weights) == 9 and sum(len(w.sources) for w in spec.weights) == 15
    assert not any(w.shared for w in spec.weights)
    state = result.program.state_dict
    stored = torch.int8 if scheme == "int8" else torch.uint8
    assert sum(v.dtype == stored for v in state.values()) == 9
    # no float copy of a quantized weight is left in the program
    floats = {n for n, v in state.items() if v.is_floating_point() and v.dim() == 2 and not n.startswith("offgraph_quant_")}
    assert floats == {"tok_embeddings.weight"}  # the embedding table only
    linears = [n for n in result.program.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 9 and all(n.args[1].op == "call_function" for n in linears)

    tokens = torch.randint(0, bundle.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    got = _run(result.program.module(), bundle, tokens)
    with dequantized_weights(bundle.model, spec) as replaced:
        assert replaced == 15
        want = _run(bundle.model, bundle, tokens)
    float_out = _run(bundle.model, bundle, tokens)  # the weights are back
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (got - float_out).abs().max() > 1e-3  # the quantized program is not the float one


@pytest.mark.parametrize("head", ["int8", "none"])
def test_the_lm_head_takes_its_own_scheme_or_stays_float(example_program, head):
    """``--quantize int4 --quantize-lm-head int8|none``: the last linear (the output projection)
    is stored int8 per output channel (recorded with its scheme) or left float (not recorded); the
    oracle, which reads each weight's scheme from the spec, computes what the program computes."""
    from offgraph_export.passes.quantize_weights import quantize_weights

    bundle, program, sources = example_program
    result = quantize_weights(program, bundle.example_inputs, "int4", 32, sources, lm_head=head)
    spec = result.produced
    assert spec.scheme == "int4" and spec.group_size == 32
    own = {w.name: w.scheme for w in spec.weights if w.scheme is not None}
    state = result.program.state_dict
    if head == "int8":
        assert len(spec.weights) == 9 and list(own.values()) == ["int8"] and spec.weights[-1].scheme == "int8"
        assert spec.label() == "int4/32+lm_head:int8" and spec.label(groups=False) == "int4+lm_head:int8"
        assert sum(v.dtype == torch.int8 for v in state.values()) == 1
        assert sum(v.dtype == torch.uint8 for v in state.values()) == 8
    else:
        assert len(spec.weights) == 8 and not own and spec.label() == "int4/32"
        floats = {n for n, v in state.items() if v.is_floating_point() and v.dim() == 2 and not n.startswith("offgraph_quant_")}
        assert floats == {"tok_embeddings.weight", "output.weight"}
    tokens = torch.randint(0, bundle.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    got = _run(result.program.module(), bundle, tokens)
    with dequantized_weights(bundle.model, spec):
        want = _run(bundle.model, bundle, tokens)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    if head == "int8":  # the oracle did read the lm_head's own scheme: as int4 it computes otherwise
        with dequantized_weights(bundle.model, QuantizationSpec(scheme="int4", group_size=32, weights=[
                w.model_copy(update={"scheme": None}) for w in spec.weights])):
            all_int4 = _run(bundle.model, bundle, tokens)
        assert (got - all_int4).abs().max() > 1e-4


class _Tied(torch.nn.Module):
    """An embedding table read again as the output projection (as tied-embedding LMs do)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 32, bias=True)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.embed(tokens))))


def test_a_tied_table_stays_float_for_its_embedding_and_the_oracle_unties_it():
    from offgraph_export.passes.quantize_weights import quantize_weights

    model = _Tied().requires_grad_(False)
    tokens = torch.arange(10)[None]
    ep = torch.export.export(model, (tokens,), strict=False)
    result = quantize_weights(ep, (tokens,), "int4", 32)
    spec = result.produced
    # export names the tied table once (either name); it stays float for the embedding
    shared = {w.name: w.shared for w in spec.weights}
    (table,) = [name for name, is_shared in shared.items() if is_shared]
    assert table in ("embed.weight", "head.weight") and shared == {table: True, "proj.weight": False}, shared
    assert result.program.state_dict[table].dtype == torch.float32
    assert "proj.weight" not in result.program.state_dict  # only the quantized form
    got = result.program.module()(tokens)
    before = model.embed.weight.clone()
    with dequantized_weights(model, spec):
        assert torch.equal(model.embed.weight, before)  # the embedding reads the float table
        assert model.head.weight is not model.embed.weight
        want = model(tokens)
    assert model.head.weight is model.embed.weight  # tied again after
    assert torch.allclose(got, want, atol=1e-5)
    # a spec naming a weight the model lacks is refused by name
    bad = QuantizationSpec(scheme="int8", weights=[QuantizedWeight(name="x", sources=["nope.weight"], shape=[4, 32])])
    with pytest.raises(OffgraphError, match="nope.weight"):
        with dequantized_weights(model, bad):
            pass


def test_export_refuses_a_group_size_a_linear_width_does_not_fit(tmp_path):
    """The example's linears read 64 and 128 features: groups of 128 do not divide 64."""
    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_and_lower

    with pytest.raises(ExportError, match=r"64 input features.*--group-size 32 or 64"):
        export_and_lower(load_bundle(EXAMPLE), tmp_path / "m.pt2", quantize="int4", group_size=128)
    assert not list(tmp_path.iterdir())


# -- compiled and checked (cpu) -------------------------------------------------------------------


def _stored_weights(path) -> dict[str, tuple[list[int], int]]:
    """Each constant the package stores: its shape and the bytes of its archive member."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        config_name = next(n for n in z.namelist() if n.endswith("model/weights_config.json"))
        config = json.loads(z.read(config_name))
        root = config_name.split("/")[0]
        sizes = {n.rsplit("/", 1)[-1]: z.getinfo(n).file_size for n in z.namelist() if f"{root}/data/weights/" in n}
    return {name: (entry[1], sizes[entry[0]]) for name, entry in config.items()}


@pytest.fixture(scope="module")
def int8_example(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "int8.pt2"
    summary = json.loads(cli("export", EXAMPLE, "-o", str(out), "--quantize", "int8", "--json").stdout)
    return out, summary


def test_int8_example_checks_against_its_dequantized_oracle(int8_example):
    from offgraph_export.check import check_artifact

    out, _ = int8_example
    report = check_artifact(str(out), EXAMPLE)
    assert report.passed, report.render()
    assert any("int8 weights dequantized" in n for n in report.notes), report.notes
    specs = json.loads(cli("inspect", str(out), "--json").stdout)
    assert specs["options"]["quantize"] == "int8" and specs["quantization"]["scheme"] == "int8"
    assert "int8 per output channel: 9 linear weights from 15 model weights" in cli("inspect", str(out)).stdout


def test_the_package_stores_the_quantized_form_only(int8_example):
    """The compiler did not fold the dequantized weight into a float constant: every linear weight
    is stored as its int8 ``qweight`` (one byte a value), and no constant has a float linear
    weight's shape but the embedding table."""
    out, _ = int8_example
    stored = _stored_weights(out)
    qweights = {n: v for n, v in stored.items() if n.endswith(".qweight")}
    assert len(qweights) == 9
    for name, (shape, size) in qweights.items():
        assert size < shape[0] * shape[1] + 4096, (name, shape, size)  # a file header, not 2 or 4 bytes a value
    matrices = {n for n, (shape, _) in stored.items() if len(shape) == 2 and not n.endswith(".qweight")}
    assert matrices == {"inner.tok_embeddings.weight"} or all(n.endswith("tok_embeddings.weight") for n in matrices), matrices


def test_int8_example_is_not_the_float_model(int8_example):
    """The artifact matches the eager model with dequantized weights within the float32 tolerance,
    and the float model's logits are further off than that: a check that forgot the quantization
    would fail."""
    from offgraph_export.check import TOLERANCES
    from offgraph_export.frontends import load_bundle
    from offgraph_export.runtime import load_artifact
    from tests.conftest import first_step_logits

    out, _ = int8_example
    bundle = load_bundle(EXAMPLE)
    program = load_artifact(str(out))
    tokens = torch.randint(0, bundle.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    got = first_step_logits(program, bundle.make_inputs, tokens)
    inputs = tuple(bundle.make_inputs(tokens, 0))
    with torch.no_grad():
        want_float = bundle.oracle(program.specs.manifest).step(inputs)[0]
        with dequantized_weights(bundle.model, program.specs.quantization):
            want = bundle.oracle(program.specs.manifest).step(inputs)[0]
    atol, rtol = TOLERANCES[torch.float32]
    assert torch.allclose(got, want, atol=atol, rtol=rtol)
    assert not torch.allclose(got, want_float, atol=atol, rtol=rtol)
    assert (got - want_float).abs().max() > 10 * (atol + rtol * want_float.abs().max())


def test_quality_of_a_float_artifact_is_the_compilers_error_alone(example_artifact):
    """The independent end of the scale: the float artifact against its own float model agrees
    on every next token, its logits within the float32 check tolerance."""
    from offgraph_export.quality import quality_report

    report = quality_report(str(example_artifact), EXAMPLE, tokens=64)
    assert report.weights == "float" and report.tokens == 64
    assert report.top1_agreement == 1.0 and report.max_logit_error < 1e-3
    assert report.perplexity == pytest.approx(report.reference_perplexity, rel=1e-4)


def test_quality_of_the_int8_example_against_its_float_model(int8_example):
    """The quantized artifact's logits differ from the float model's (and the report says by how
    much, scored on the shipped text); the CLI prints the same numbers as JSON."""
    from offgraph_export.quality import default_text, quality_report

    out, _ = int8_example
    report = quality_report(str(out), EXAMPLE)
    assert report.weights == "int8" and report.tokens == 256 and len(default_text()) > 2000
    assert 1e-3 < report.max_logit_error < 10 and 0 < report.mean_logit_error < report.max_logit_error
    assert 0.5 < report.top1_agreement <= 1.0
    assert math.isfinite(report.perplexity) and report.perplexity == pytest.approx(report.reference_perplexity, rel=0.1)
    printed = json.loads(cli("quality", str(out), "--model", EXAMPLE, "--json").stdout)
    assert printed["top1_agreement"] == pytest.approx(report.top1_agreement)
    assert printed["max_logit_error"] == pytest.approx(report.max_logit_error, rel=1e-5)
    short = cli("quality", str(out), "--model", EXAMPLE, "--tokens", "16").stdout
    assert "teacher-forced tokens  16" in short and "top-1 agreement" in short


def test_quality_against_another_artifact_scores_the_two_artifacts(int8_example, example_artifact):
    """``--against``: the int8 artifact against the float artifact of the same model. The float
    artifact computes the float model within 1e-3 (float32), so the scores are those against the
    float model itself, within that."""
    from offgraph_export.quality import quality_report

    out, _ = int8_example
    vs_model = quality_report(str(out), EXAMPLE, tokens=128)
    vs_artifact = quality_report(str(out), EXAMPLE, tokens=128, against=str(example_artifact))
    assert vs_artifact.reference == str(example_artifact) and vs_artifact.reference_weights == "float"
    assert vs_model.reference == "float model" and vs_model.reference_weights is None
    assert vs_artifact.max_logit_error == pytest.approx(vs_model.max_logit_error, abs=1e-3)
    assert vs_artifact.reference_perplexity == pytest.approx(vs_model.reference_perplexity, rel=1e-4)
    assert vs_artifact.perplexity == vs_model.perplexity
    assert abs(vs_artifact.top1_agreement - vs_model.top1_agreement) <= 1 / 128
    itself = quality_report(str(out), EXAMPLE, tokens=128, against=str(out))
    assert itself.top1_agreement == 1.0 and itself.max_logit_error == 0.0
    printed = cli("quality", str(out), "--model", EXAMPLE, "--tokens", "16", "--against", str(example_artifact)).stdout
    assert f"against {example_artifact} (float weights)" in printed and "(reference " in printed


def test_int4_batched_example_checks_every_session_and_scores_its_quality(tmp_path_factory):
    """int4 with an int8 lm_head through the paged step: 8 sessions joining and leaving, crossing
    pages and wrapping the example's ring layer, every step against the dequantized oracle (each
    weight in its own scheme); and the quality report through the batched runner (one session)
    against the float model."""
    from offgraph_export.check import check_batched
    from offgraph_export.quality import quality_report

    out = tmp_path_factory.mktemp("q") / "int4_batched.pt2"
    cli("export", EXAMPLE, "-o", str(out), "--quantize", "int4", "--group-size", "32", "--quantize-lm-head", "int8",
        "--max-sessions", "4", "--page-size", "4")
    report = check_batched(str(out), EXAMPLE, sessions=8)
    assert report.passed, report.render()
    assert any("int4+lm_head:int8 weights dequantized" in n and "groups of 32" in n for n in report.notes), report.notes
    specs = json.loads(cli("inspect", str(out), "--json").stdout)
    assert specs["options"]["quantize_lm_head"] == "int8"
    assert [w["scheme"] for w in specs["quantization"]["weights"]].count("int8") == 1
    assert "; the lm_head output.weight int8 per output channel" in cli("inspect", str(out)).stdout
    quality = quality_report(str(out), EXAMPLE, tokens=100)
    assert quality.weights == "int4/32+lm_head:int8" and quality.tokens == 100
    assert quality.max_logit_error > 1e-3 and 0 < quality.top1_agreement <= 1 and math.isfinite(quality.perplexity)


def test_int4_transformers_qwen2_with_biases_rings_and_tied_embeddings(tmp_path_factory):
    """A transformers model: q/k/v biases (kept float beside the quantized weights), sliding-window
    layers (ring wraps), and tied embeddings (the table float for the embedding, quantized for the
    lm_head; transformers' own forward is the oracle, its lm_head untied for the check only)."""
    transformers = pytest.importorskip("transformers")
    from offgraph_export.check import check_artifact
    from tests.test_frontend_hf import COMMON, MIXED, WINDOW

    base = tmp_path_factory.mktemp("qhf")
    checkpoint, out = base / "qwen2", base / "qwen2_int4.pt2"
    config = transformers.Qwen2Config(**(COMMON | dict(tie_word_embeddings=True)), use_sliding_window=True,
                                      sliding_window=WINDOW, layer_types=MIXED)
    transformers.Qwen2ForCausalLM(config).save_pretrained(checkpoint)
    cli("export", f"hf:{checkpoint}", "-o", str(out), "--quantize", "int4", "--group-size", "64",
        "--max-capacity", "128", "--max-write", "32")
    specs = json.loads(cli("inspect", str(out), "--json").stdout)
    shared = [w for w in specs["quantization"]["weights"] if w["shared"]]
    assert len(shared) == 1 and shared[0]["shape"] == [256, 64], specs["quantization"]
    report = check_artifact(str(out), f"hf:{checkpoint}")
    assert report.passed, report.render()
    assert any("int4 weights dequantized" in n for n in report.notes), report.notes


# -- cuda -----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cuda_quantized_example_checks_with_and_without_graphs(scheme, tmp_path_factory):
    """bf16 on cuda, the decode method included (its GEMV folds read the quantized weights and
    dequantize in registers, design section 11), ordinary launches and CUDA graphs; the package
    stores the quantized form only."""
    from offgraph_export.check import check_artifact
    from offgraph_export.frontends import load_bundle
    from offgraph_export.models import cast_bundle

    out = tmp_path_factory.mktemp("qcuda") / f"{scheme}.pt2"
    group = ["--group-size", "32"] if scheme == "int4" else []
    cli("export", EXAMPLE, "-o", str(out), "--device", "cuda", "--dtype", "bfloat16", "--quantize", scheme, *group)
    stored = _stored_weights(out)
    assert sum(n.endswith(".qweight") for n in stored) == 9
    assert not {n for n, (shape, _) in stored.items() if len(shape) == 2 and "offgraph_quant_" not in n} - {
        n for n in stored if n.endswith("tok_embeddings.weight")}
    for graphs in (False, True):
        report = check_artifact(str(out), cast_bundle(load_bundle(EXAMPLE), "bfloat16"), cuda_graphs=graphs)
        assert report.passed, report.render()
        assert any(f"{scheme} weights dequantized" in n for n in report.notes), report.notes


@pytest.mark.cuda
def test_cuda_int4_transformers_llama_batched_checks(tmp_path_factory):
    """A tiny transformers Llama with tied embeddings, int4 with an int8 lm_head (the decode GEMV
    reads both forms in one method), as a batched cuda artifact (the sessions method too): 8
    sessions through the runner, ordinary launches and CUDA graphs."""
    transformers = pytest.importorskip("transformers")
    from offgraph_export.check import check_batched
    from offgraph_export.frontends import load_bundle
    from offgraph_export.models import cast_bundle
    from tests.test_frontend_hf import COMMON

    base = tmp_path_factory.mktemp("qhf_cuda")
    checkpoint, out = base / "llama", base / "llama_int4_batched.pt2"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**(COMMON | dict(tie_word_embeddings=True)))).save_pretrained(checkpoint)
    cli("export", f"hf:{checkpoint}", "-o", str(out), "--device", "cuda", "--dtype", "bfloat16", "--quantize", "int4",
        "--group-size", "64", "--quantize-lm-head", "int8", "--max-capacity", "128", "--max-write", "32",
        "--max-sessions", "4", "--page-size", "4")
    for graphs in (False, True):
        report = check_batched(str(out), cast_bundle(load_bundle(f"hf:{checkpoint}"), "bfloat16"), sessions=8, cuda_graphs=graphs)
        assert report.passed, report.render()


def test_a_last_linear_that_is_not_the_output_is_not_taken_for_the_lm_head():
    """A model whose output projection is computed otherwise (``h @ W.T`` with a scaled table):
    its last ``aten.linear`` is some layer's, so ``--quantize-lm-head`` is refused rather than
    applied to that layer; ``--quantize`` alone still quantizes every linear."""
    from offgraph_export.passes.quantize_weights import quantize_weights

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.proj(self.embed(tokens)))
            return h @ (self.embed.weight * 0.5).T

    model = Scaled().requires_grad_(False)
    tokens = torch.arange(10)[None]
    ep = torch.export.export(model, (tokens,), strict=False)
    with pytest.raises(ExportError, match=r"--quantize-lm-head int8: the program's last linear \(proj.weight\) does not produce its output"):
        quantize_weights(ep, (tokens,), "int4", 32, lm_head="int8")
    assert [w.name for w in quantize_weights(ep, (tokens,), "int4", 32).produced.weights] == ["proj.weight"]
