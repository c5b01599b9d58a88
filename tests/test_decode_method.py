"""The decode method: a width-1 program with static shapes beside the general step, in one package
that stores the weights once; the runtime runs it for every one-token step, ``check`` verifies it
against the eager model, and a loader refuses packages whose methods disagree with their specs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from offgraph_export.check import check_artifact
from offgraph_export.errors import ArtifactError
from offgraph_export.frontends import load_bundle
from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.passes.graph_utils import user_input_nodes
from offgraph_export.passes.specialize_width import specialize_width
from offgraph_export.lowering.aoti import compile_package
from offgraph_export.options import default_decode_gemv, default_decode_rope
from offgraph_export.pipeline import export_model, run_passes
from offgraph_export.runtime import Artifact
from offgraph_export.specs.artifact import DECODE_METHOD, STEP_METHOD, read_artifact_specs
from tests.archive_tools import rewrite, specs_edit
from tests.conftest import EXAMPLE, ROOT, cli


@pytest.fixture(scope="module")
def decode_artifact(tmp_path_factory) -> Path:
    """The example exported through the CLI with a decode method (two compiles)."""
    out = tmp_path_factory.mktemp("decode") / "tiny_decode.pt2"
    cli("export", EXAMPLE, "-o", str(out), "--decode-method")
    return out


@pytest.fixture(scope="module")
def loaded(decode_artifact) -> Artifact:
    return Artifact.load(decode_artifact)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# -- the pass -------------------------------------------------------------------------------------


def test_specialize_width_fixes_only_the_width():
    bundle = load_bundle(EXAMPLE)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model, inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config)
    result = specialize_width(program.stripped, program.step_width)
    assert result.modified and result.produced == str(
        user_input_nodes(program.stripped)[0].meta["val"].shape[1]
    )
    shapes = {n.name: n.meta["val"].shape for n in user_input_nodes(result.program)}
    assert list(shapes["tokens"]) == [1, 1] and list(shapes["position"]) == [1]
    # flat storage rows stay dynamic (one growing capacity), the ring's are static
    assert isinstance(shapes["k_cache_0"][2], torch.SymInt)
    manifest = program.manifest
    assert shapes["k_cache_1"][2] == manifest.rows(manifest.layer(1), manifest.initial_capacity)
    assert list(result.program.graph_signature.user_inputs) == list(program.stripped.graph_signature.user_inputs)


def _kernel_names(program) -> set[str]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return {
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
        for n in program.graph.nodes
        if "triton_kernel_wrapper" in str(n.target)
    }


def test_decode_method_gets_the_one_token_kernels():
    """The decode method is traced from the program before the triton step is decomposed, so it
    takes the one-token kernels (row write folded into the attention) and the general step keeps
    the kernels chosen for a symbolic width."""
    pytest.importorskip("triton")
    bundle = load_bundle(EXAMPLE)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "triton", decode_method=True)
    assert _kernel_names(program.decode) == {"_decode_attend_kernel", "_decode_combine_kernel"}
    assert _kernel_names(program.stripped) == {"_write_rows_kernel", "_attend_kernel", "_combine_splits_kernel"}


@pytest.mark.parametrize(
    "device, decode_method, step_impl, gemv, rope",
    [
        ("cuda", True, "triton", True, True),
        ("cuda:1", True, "portable", True, False),  # the rotary fold lives in the triton kernel
        ("cuda", False, "triton", False, False),  # no decode method, nothing to fold into
        ("cpu", True, "triton", False, False),  # the GEMV is a GPU kernel
    ],
)
def test_decode_folds_are_on_by_default_only_for_a_cuda_decode_method(device, decode_method, step_impl, gemv, rope):
    assert default_decode_gemv(device, decode_method) is gemv
    assert default_decode_rope(device, decode_method, step_impl) is rope


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(decode_gemv=True), "--decode-gemv is a cuda kernel for the pt2 decode method"),
        (dict(decode_rope=True), "--decode-rope folds the rotary embedding into the triton step"),
        (dict(decode_gemv=True, format="executorch"), "--decode-gemv is a cuda kernel for the pt2 decode method"),
    ],
    ids=["gemv-on-cpu", "rope-on-cpu", "gemv-for-executorch"],
)
def test_explicit_decode_folds_where_they_cannot_run_are_refused_before_export(tmp_path, options, message):
    """Asking for a fold where it cannot run fails at once, naming what it needs, and writes
    nothing (no export, no compile)."""
    from offgraph_export.errors import ExportError
    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_and_lower
    from tests.conftest import EXAMPLE

    out = tmp_path / "never.pt2"
    with pytest.raises(ExportError, match=message):
        export_and_lower(load_bundle(EXAMPLE), out, device="cpu", **options)
    assert list(tmp_path.iterdir()) == []


def test_decode_gemv_rewrites_the_one_row_projections_of_the_decode_method():
    """On the decode method every bias-free linear is one row (the example's widest has 256
    outputs): all are rewritten where the kernel may run; a cpu program is left alone by default
    (the kernel is a GPU kernel; the Triton interpreter is the only cpu runner)."""
    pytest.importorskip("triton")
    from offgraph_export.passes.decode_gemv import GemvCounts, decode_gemv

    bundle = load_bundle(EXAMPLE)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "triton")
    stripped = program.pass_results["strip_kv_cache"].program
    linears = sum(n.target is torch.ops.aten.linear.default for n in stripped.graph.nodes)
    assert linears == 9  # q|k|v, o, gate|up, down per layer; lm_head
    assert not decode_gemv(specialize_width(stripped, program.step_width).program).modified
    fixed = specialize_width(stripped, program.step_width).program
    result = decode_gemv(fixed, device_types=("cpu",))
    # every linear; both norms of each layer and the final one; each gate|up's SiLU·mul; the
    # residual adds after the output and down projections
    assert result.modified and result.produced == GemvCounts(linears=linears, norms=5, gated=2, residuals=4)
    gemv = torch.ops.offgraph_lowered.triton_gemv.default
    assert sum(n.target is gemv for n in fixed.graph.nodes) == linears
    assert not any(n.target in (torch.ops.aten.silu.default, torch.ops.aten.rsqrt.default) for n in fixed.graph.nodes)
    # the general step (a symbolic number of rows) has no one-row linear
    assert not decode_gemv(stripped, device_types=("cpu",)).modified


def test_decode_gemv_keeps_the_signature_when_the_folded_node_is_the_output():
    """A residual add that is the program's output becomes the GEMV node: the graph signature
    names that node afterwards (replacing uses alone left it naming the removed add)."""
    from offgraph_export.passes.decode_gemv import decode_gemv

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(48, 64))

        def forward(self, x, r):
            return torch.nn.functional.linear(x, self.w) + r

    ep = torch.export.export(Head().requires_grad_(False), (torch.randn(1, 1, 64), torch.randn(1, 1, 48)))
    result = decode_gemv(ep, device_types=("cpu",))
    assert result.produced.residuals == 1
    ep.validate()
    (out,) = ep.graph_signature.user_outputs
    assert out == next(n for n in ep.graph.nodes if n.op == "output").args[0][0].name


def test_decode_rope_folds_llama_rotary_embedding_into_the_attention_call(tmp_path):
    """transformers' Llama: each layer's rotary embedding of q and k goes into its one-token
    attention call (the call takes the unrotated q and k and the step's cos/sin rows) and the
    rotary nodes are gone; the general step keeps its own. The example's rotary embedding
    (computed in fp32 inside each layer) is another form and is left alone."""
    pytest.importorskip("triton")
    transformers = pytest.importorskip("transformers")
    from offgraph_export.passes.decode_rope import decode_rope
    from tests.test_frontend_hf import COMMON

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    bundle = load_bundle(f"hf:{tmp_path}")
    inputs = bundle.example_inputs
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "triton", decode_method=True, decode_rope=True)
    assert program.pass_results["decode_rope"].produced == 3 and program.options["decode_rope"] is True
    stripped = program.pass_results["strip_kv_cache"].program
    decode = program.pass_results["decode_rope"].program
    calls = [n for n in decode.graph.nodes if "update_and_attend" in str(n.target)]
    assert len(calls) == 3 and all(set(n.kwargs) == {"rope_cos", "rope_sin"} for n in calls)
    assert not any(n.target is torch.ops.aten.neg.default for n in decode.graph.nodes)
    assert sum(n.target is torch.ops.aten.neg.default for n in stripped.graph.nodes) == 6  # q and k, 3 layers
    assert _kernel_names(program.decode) == {"_decode_attend_kernel", "_decode_combine_kernel"}

    example = load_bundle(EXAMPLE)
    ep = export_model(example.model.requires_grad_(False), example.example_inputs, example.token_dims,
                      example.cache_config.max_write)
    plain = run_passes(ep, example.example_inputs, example.cache_config, "triton")
    fixed = specialize_width(plain.pass_results["strip_kv_cache"].program, plain.step_width).program
    assert not decode_rope(fixed).modified


def test_decode_rope_folds_into_the_batched_artifacts_paged_attention(tmp_path):
    """The same fold for a batched artifact (``--max-sessions``): each layer's one-token paged
    attention call takes the unrotated q and k and the step's rows, and its kernels are the
    folded attention and the combine (no write kernel, no rotary nodes)."""
    pytest.importorskip("triton")
    transformers = pytest.importorskip("transformers")
    from tests.test_frontend_hf import COMMON

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    bundle = load_bundle(f"hf:{tmp_path}")
    config = bundle.cache_config.with_overrides(max_sessions=4, page_size=8)
    ep = export_model(bundle.model.requires_grad_(False), bundle.example_inputs, bundle.token_dims, config.max_write)
    program = run_passes(ep, bundle.example_inputs, config, "triton", decode_method=True, decode_rope=True)
    assert program.manifest.paging is not None
    assert program.pass_results["decode_rope"].produced == 3
    decode = program.pass_results["decode_rope"].program
    calls = [n for n in decode.graph.nodes if "paged_update_and_attend" in str(n.target)]
    assert len(calls) == 3 and all(set(n.kwargs) == {"rope_cos", "rope_sin"} for n in calls)
    assert not any(n.target is torch.ops.aten.neg.default for n in decode.graph.nodes)
    assert _kernel_names(program.decode) == {"_paged_attend_kernel", "_paged_combine_kernel"}
    assert "_paged_write_kernel" in _kernel_names(program.stripped)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_folds_compute_the_same_step_on_cuda(tmp_path, seed):
    """transformers' Llama in bf16 on the GPU: the decode method with every fold (GEMV with its
    norm, SiLU·mul and residual folds; rotary embedding in the attention kernel) and the same method
    without them (cuBLAS and eager pointwise ops), both run eagerly on the same inputs and storage,
    against the oracle: the unfolded method in fp32 with the same bf16-rounded weights. The folded
    logits are no further from it than the unfolded bf16 ones (measured on the H200 over six
    weight seeds: 0.009-0.013 vs 0.011-0.015; the two bf16 programs differ from each other by up to
    0.015, so comparing them with each other alone sat at the edge of any fixed tolerance), and the
    stored rows match."""
    transformers = pytest.importorskip("transformers")
    from tests.test_frontend_hf import COMMON

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path)

    def decode_program(dtype, **folds):
        bundle = load_bundle(f"hf:{tmp_path}", dtype=dtype, initial_capacity=64)
        model = bundle.model.requires_grad_(False).to("cuda")
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():  # the oracle's weights: the bf16 ones, widened
                t.data = t.data.to(torch.bfloat16).to(t.dtype)
        inputs = tuple(x.to("cuda") for x in bundle.example_inputs)
        ep = export_model(model, inputs, bundle.token_dims, bundle.cache_config.max_write)
        program = run_passes(ep, inputs, bundle.cache_config, "triton", decode_method=True, **folds)
        last = "decode_rope" if folds else "specialize_width"
        return program.pass_results[last]

    folded = decode_program("bfloat16", decode_gemv=True, decode_rope=True)
    plain = decode_program("bfloat16")
    oracle = decode_program("float32")
    assert folded.produced == 3
    assert folded.program.graph_module.code.count("triton_gemv") > 0
    args, _ = plain.program.example_inputs
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = [a.normal_(generator=gen) if a.is_floating_point() else a for a in (x.clone() for x in args)]
    rows = args[2].shape[2]
    # a position with rotary angles far from 0 and stored history before it (at position 0 the
    # rotation is the identity and the step attends only to itself)
    args[1] = torch.full_like(args[1], rows - 7)
    a, b = [x.clone() for x in args], [x.clone() for x in args]
    c = [x.float() if x.is_floating_point() else x.clone() for x in args]

    def logits(program, args):
        out = program.module()(*args)
        return (out[0] if isinstance(out, (tuple, list)) else out).double()

    exact = logits(oracle.program, c)
    got, want = logits(folded.program, a), logits(plain.program, b)
    err_folded = ((got - exact).norm() / exact.norm()).item()
    err_plain = ((want - exact).norm() / exact.norm()).item()
    assert err_plain < 3e-2, err_plain  # the oracle is one: bf16 rounding, not a different program
    assert err_folded <= 1.25 * err_plain + 1e-3, (err_folded, err_plain)
    for x, y in zip(a[2:], b[2:]):  # the storage: same rows written (keys rotated in the kernel)
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)


# -- the package ----------------------------------------------------------------------------------


def test_package_holds_both_methods_and_the_weights_once(decode_artifact):
    specs = read_artifact_specs(decode_artifact)
    assert specs.decode_method and specs.methods == [STEP_METHOD, DECODE_METHOD]
    with zipfile.ZipFile(decode_artifact) as z:
        names = z.namelist()
        stored = sum(i.file_size for i in z.infolist() if "/data/weights/" in i.filename)
        configs = [json.loads(z.read(n)) for n in names if n.endswith("weights_config.json")]
    assert len(configs) == 2 and configs[0] == configs[1]  # both methods name the same files
    # The weights' own bytes (fused projections and all), counted once: stored once.
    once = sum(
        t.untyped_storage().nbytes()
        for t in {id(v): v for v in _constants(decode_artifact).values()}.values()
    )
    assert once <= stored < 1.5 * once


def _constants(path: Path) -> dict[str, torch.Tensor]:
    from offgraph_export.runtime.weights import load_method_weights

    return load_method_weights(path, [STEP_METHOD], torch.device("cpu"))[STEP_METHOD]


def test_the_loader_gives_both_methods_the_same_weight_tensors(decode_artifact):
    from offgraph_export.runtime.weights import load_method_weights

    weights = load_method_weights(decode_artifact, [STEP_METHOD, DECODE_METHOD], torch.device("cpu"))
    step, decode = weights[STEP_METHOD], weights[DECODE_METHOD]
    assert step.keys() == decode.keys()
    assert all(step[k].data_ptr() == decode[k].data_ptr() for k in step)


# -- the runtime ----------------------------------------------------------------------------------


def _counting(loaded: Artifact) -> tuple[Artifact, dict[str, int]]:
    """An artifact over ``loaded``'s compiled methods that counts the calls of each method."""
    spied = Artifact(loaded.path, loaded.specs, loaded.methods)
    calls = {name: 0 for name in spied._runs}
    for name, run in list(spied._runs.items()):
        def counted(flat, name=name, run=run):
            calls[name] += 1
            return run(flat)
        spied._runs[name] = counted
    return spied, calls


def test_one_token_steps_run_the_decode_method_and_match_the_general_step(loaded):
    bundle = load_bundle(EXAMPLE)
    tokens = _tokens(40)
    spied, calls = _counting(loaded)
    fast = spied.new_session()
    general_artifact = Artifact(loaded.path, loaded.specs, loaded.methods)
    general_artifact.method_for = lambda width: STEP_METHOD  # type: ignore[method-assign]
    general = general_artifact.new_session()
    for session in (fast, general):
        session.step(*bundle.make_inputs(tokens[:, :20], 0))
    for i in range(20, 40):  # crosses the growth from 32 to 64 rows
        got = fast.step(*bundle.make_inputs(tokens[:, i : i + 1], i))[0]
        want = general.step(*bundle.make_inputs(tokens[:, i : i + 1], i))[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert fast.metrics().decode_method_steps == 20 and general.metrics().decode_method_steps == 0
    assert calls == {STEP_METHOD: 1, DECODE_METHOD: 20}  # the compiled decode method really ran
    assert fast.metrics().growth_count == general.metrics().growth_count == 2
    for a, b in zip(fast.storage.bound(), general.storage.bound()):
        torch.testing.assert_close(a[:, :, :40], b[:, :, :40], atol=1e-5, rtol=1e-5)


def test_check_passes_with_the_decode_method(loaded):
    report = check_artifact(loaded, EXAMPLE, decode_steps=24)
    assert report.passed, report.render()



def test_the_decode_method_passes_aotinductors_own_input_checks(decode_artifact):
    """With ``AOTI_RUNTIME_CHECK_INPUTS=1`` the compiled wrappers check every input's sizes and
    strides against the ones they were compiled for: the decode method must take the runtime's
    one-token tensors as they are (it was compiled from examples narrowed from a wider trace, and a
    narrowed view keeps the wide example's stride on its size-1 dim: ``expected: 4, but got: 1``)."""
    env = {**os.environ, "AOTI_RUNTIME_CHECK_INPUTS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "offgraph_export", "check", str(decode_artifact), "--model", EXAMPLE, "--steps", "6", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["passed"] and any(s["method"] == DECODE_METHOD for s in report["steps"]), proc.stdout[-2000:]

# -- a broken decode method is caught -------------------------------------------------------------


def scaled_step(q, k, v, position, k_store, v_store, window, scale, out_dtype):
    """The portable step with its output scaled by 1.01: wrong outputs, right storage."""
    return 1.01 * portable_update_and_attend(q, k, v, position, k_store, v_store, window, scale, out_dtype)


@pytest.fixture(scope="module")
def broken_decode(tmp_path_factory) -> Path:
    """A package whose general step is right and whose decode method is the scaled step's."""
    bundle = load_bundle(EXAMPLE)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model, inputs, bundle.token_dims, bundle.cache_config.max_write)
    good = run_passes(ep, inputs, bundle.cache_config)
    bad = run_passes(ep, inputs, bundle.cache_config, step_impl=scaled_step, decode_method=True)
    specs = good.artifact_specs("cpu", model=EXAMPLE, model_args={}, model_dtype=None)
    specs = specs.model_copy(update={"decode_method": True})
    path = tmp_path_factory.mktemp("broken_decode") / "broken_decode.pt2"
    return compile_package({STEP_METHOD: good.stripped, DECODE_METHOD: bad.decode}, path, specs)


def test_check_fails_on_a_broken_decode_method(broken_decode):
    artifact = Artifact.load(broken_decode)
    report = check_artifact(artifact, EXAMPLE, decode_steps=6)
    assert not report.passed
    failing = [s for s in report.steps if not s.ok]
    assert failing and all(s.width == 1 for s in failing)
    # the same package with the general step serving every width passes
    general = Artifact(artifact.path, artifact.specs, artifact.methods)
    general.method_for = lambda width: STEP_METHOD  # type: ignore[method-assign]
    assert check_artifact(general, EXAMPLE, decode_steps=6).passed


# -- hostile packages -----------------------------------------------------------------------------


def _decode_entry(name: str, part: str) -> bool:
    return f"/data/aotinductor/{DECODE_METHOD}/" in name and name.endswith(part)


@pytest.mark.parametrize(
    "case, edit, message",
    [
        ("specs-deny-decode", specs_edit(lambda s: s.update(decode_method=False)),
         r"data/aotinductor/decode/.* is not part of an offgraph package"),
        ("decode-missing", lambda n, d: None if f"/data/aotinductor/{DECODE_METHOD}/" in n else d,
         r"holds compiled methods \['model'\] but its specs name \['model', 'decode'\]"),
        ("weights-config-names-missing-file",
         lambda n, d: d.replace(b'"weight_0"', b'"weight_999"') if _decode_entry(n, "weights_config.json") else d,
         r"names 'weight_999', which the archive lacks"),
        ("weights-config-view-too-long",
         lambda n, d: _stretch_first_view(d) if _decode_entry(n, "weights_config.json") else d,
         r"reaches element .* which holds"),
        ("weights-config-bad-file-name",
         lambda n, d: d.replace(b'"weight_0"', b'"../weight_0"') if _decode_entry(n, "weights_config.json") else d,
         r"not a valid weights config"),
        ("weights-config-huge-view",
         lambda n, d: _edit_first_view(d, shape=[2**40, 2**40], stride=[0, 0]) if _decode_entry(n, "weights_config.json") else d,
         r"not a valid view|reaches element|but the program was compiled for"),
        ("weights-config-zero-strides",  # inside the file, but read densely it would run past it
         lambda n, d: _edit_first_view(d, stride=[0, 0]) if _decode_entry(n, "weights_config.json") else d,
         r"strides \[0, 0\] but the program was compiled for"),
        ("weights-config-shrunk-view",
         lambda n, d: _edit_first_view(d, shrink=True) if _decode_entry(n, "weights_config.json") else d,
         r"but the program was compiled for"),
        ("weights-config-renames-a-constant",
         lambda n, d: _rename_first(d) if _decode_entry(n, "weights_config.json") else d,
         r"names \['evil.weight'\], which are not constants the program was compiled for"),
        ("weight-file-not-a-pickle",
         lambda n, d: b"not a pickle at all" if n.endswith("/data/weights/weight_0") else d,
         r"weight_0 is not a readable tensor file"),
        ("weight-file-other-dtype",
         lambda n, d: _as_dtype(d, torch.float64) if n.endswith("/data/weights/weight_0") else d,
         r"is float64 .* but the program was compiled for \['float32'"),
        ("weight-file-holds-a-dict",
         lambda n, d: _saved({"x": torch.zeros(1)}) if n.endswith("/data/weights/weight_0") else d,
         r"holds a dict, not a tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v and "\\" not in v else "",
)
def test_loader_refuses_inconsistent_methods(decode_artifact, tmp_path, case, edit, message):
    bad = rewrite(decode_artifact, tmp_path / "tiny_decode.pt2", edit)
    with pytest.raises(ArtifactError, match=message):
        Artifact.load(bad)


def _edit_first_view(data: bytes, shape=None, stride=None, shrink=False) -> bytes:
    config = json.loads(data)
    name = next(n for n, v in config.items() if v[0] == "weight_0")
    file, old_shape, old_stride, offset = config[name]
    if shrink:  # a smaller dense view: inside the file, but not the shape compiled for
        old_shape = [max(1, s // 2) for s in old_shape]
        old_stride = [math.prod(old_shape[i + 1:]) for i in range(len(old_shape))]
    config[name] = [file, shape or old_shape, stride or old_stride, offset]
    return json.dumps(config).encode()


def _rename_first(data: bytes) -> bytes:
    config = json.loads(data)
    name = next(iter(config))
    config["evil.weight"] = config.pop(name)
    return json.dumps(config).encode()


def _saved(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _as_dtype(data: bytes, dtype) -> bytes:
    import io

    return _saved(torch.load(io.BytesIO(data), weights_only=True).to(dtype))


def test_loader_refuses_entries_it_did_not_write(decode_artifact, tmp_path):
    """An exported program (pickled constants torch's loader would unpickle) or any other stray
    entry is refused before anything in the archive is read."""
    bad = rewrite(decode_artifact, tmp_path / "tiny_decode.pt2", extra=[("tiny_decode/models/evil.json", b"{}")])
    with pytest.raises(ArtifactError, match=r"models/evil.json' is not part of an offgraph package"):
        Artifact.load(bad)


def _stretch_first_view(data: bytes) -> bytes:
    config = json.loads(data)
    name = next(iter(config))
    file, shape, stride, offset = config[name]
    config[name] = [file, shape, stride, offset + 10**6]
    return json.dumps(config).encode()


def test_inspect_lists_the_methods(decode_artifact):
    text = cli("inspect", str(decode_artifact)).stdout
    assert "methods       model, decode  (decode: width 1, static shapes)" in text
    assert "max_autotune=none" in text


# -- the decode method against the eager model ----------------------------------------------------


def _plain_attention(windows: dict[int, int]):
    """The neutral op replaced by plain attention over the step's own q, k, v (no cache at all):
    query i sees key j iff j <= i and, for a layer with a window w, j > i - w. Fed the whole
    sequence at once, the model computes every position afresh."""

    def attend(q, k, v, position, layer_id, scale, out_dtype):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        seen = position[None, :] <= position[:, None]
        if windows.get(layer_id) is not None:
            seen &= position[None, :] > position[:, None] - windows[layer_id]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=seen, scale=scale
        )
        return out.to(out_dtype)

    return attend


def test_decode_method_steps_match_the_eager_model_recomputed_from_scratch(loaded, monkeypatch):
    """A real session: a 20-token prefill (the general step), then 30 one-token steps that the
    decode method serves, crossing the growths 16 -> 32 -> 64 rows and wrapping the ring layer
    (47 rows: positions 47.. land on rows 0..). Oracle: the eager example model run over the
    whole sequence so far with plain attention and no cache, its last position's logits."""
    bundle = load_bundle(EXAMPLE)
    model = bundle.model
    assert bundle.cache_config.ring_windows == {1: 16}  # the example's last layer sees 16 tokens
    forward_globals = type(model.layers[0].attention).forward.__globals__
    assert "update_and_attend" in forward_globals  # the name the example's attention calls
    monkeypatch.setitem(forward_globals, "update_and_attend", _plain_attention(bundle.cache_config.ring_windows))

    def recomputed(prefix: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(*bundle.make_inputs(prefix, 0))[:, -1]

    spied, calls = _counting(loaded)
    session = spied.new_session()
    prefill, total = 20, 50
    tokens = _tokens(total, seed=3)
    logits = session.step(*bundle.make_inputs(tokens[:, :prefill], 0))[0]
    torch.testing.assert_close(logits[:, -1], recomputed(tokens[:, :prefill]), atol=1e-4, rtol=1e-4)
    assert calls == {STEP_METHOD: 1, DECODE_METHOD: 0}
    for i in range(prefill, total):
        got = session.step(*bundle.make_inputs(tokens[:, i : i + 1], i))[0]
        assert got.shape == (1, 1, 256)
        want = recomputed(tokens[:, : i + 1])
        torch.testing.assert_close(got[:, -1], want, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"position {i}: {m}")
    metrics = session.metrics()
    assert metrics.decode_method_steps == total - prefill
    assert calls == {STEP_METHOD: 1, DECODE_METHOD: total - prefill}  # the compiled decode method ran
    assert metrics.growth_count == 2 and metrics.committed_length == total
    assert total > 16 + 32 - 1  # past the ring's rows: the last steps wrote over its oldest rows
