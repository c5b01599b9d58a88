"""The cpu int4 kernel pass (``passes/cpu_int4_linear.py``): a bf16 program's int4 linears become
``aten._weight_int4pack_mm_for_cpu`` over weights packed at export (general and decode methods, one
packing for both), every other linear stays, the program it was given is left as it was, and the
rewritten program computes what the dequantize + linear program does up to bf16 rounding; an
export for cpu compiles the kernel into the package, without the stored int4 tensors, and checks
against its eager oracle; the group-size scalar AOTInductor adds is held to its value at load."""

import dataclasses
import io
import json
import zipfile

import pytest
import torch

from offgraph_export.passes.cpu_int4_linear import cpu_int4_linear, pack_for_cpu
from offgraph_export.pipeline import run_passes, takes_cpu_int4_kernel
from offgraph_export.reference.weight_quant import dequantize, quantize
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm

CONFIG = CacheConfig(**tm.QUANT_CACHE)
KERNEL = "aten._weight_int4pack_mm_for_cpu.default"


def _program(dtype):
    return tm.quantizable_program(dtype)


def _kernels(ep):
    return tm.count_calls(ep, KERNEL)


@pytest.fixture(scope="module")
def bf16_pair():
    ep, inputs = _program(torch.bfloat16)
    common = dict(quantize="int4", group_size=32, lowering_traces=True, decode_method=True)
    return run_passes(ep, inputs, CONFIG, cpu_int4_kernel=True, **common), run_passes(ep, inputs, CONFIG, **common)


def test_packing_computes_the_stored_forms_weights():
    """The kernel over the packed tensors equals ``x @ W'.T`` for the reference rule's ``W'``
    (float32 sums of bf16 values: a bf16 rounding apart)."""
    stored = quantize(torch.randn(48, 96) * 0.05, "int4", 32)
    s, z = stored.scales.to(torch.bfloat16), stored.zeros.to(torch.bfloat16)
    packed, sz = pack_for_cpu(stored.qweight, s, z)
    assert packed.shape == (48, 48) and packed.dtype == torch.uint8 and sz.shape == (3, 48, 2)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    want = x.float() @ dequantize(dataclasses.replace(stored, scales=s, zeros=z)).float().T
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).float()
    assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_every_int4_linear_of_both_methods_takes_the_kernel(bf16_pair):
    taken, plain = bf16_pair
    linears = sum(str(n.target) == "aten.linear.default" for n in plain.stripped.graph.nodes)
    assert linears > 0
    assert taken.pass_results["cpu_int4_linear"].produced == linears == _kernels(taken.stripped)
    assert not any(str(n.target) == "aten.linear.default" for n in taken.stripped.graph.nodes)
    assert taken.pass_results["cpu_int4_linear_decode"].produced == _kernels(taken.decode) > 0
    # the strip pass's own program keeps its linears and weights: the decode method is traced from it again
    strip = taken.pass_results["strip_kv_cache"].program
    assert _kernels(strip) == 0 and not any(k.endswith("_cpu_int4pack") for k in strip.state_dict)
    assert taken.stripped.graph_signature.user_inputs == plain.stripped.graph_signature.user_inputs
    # one packing for both methods: the same tensors, so the package stores them once
    packs = {k: v for k, v in taken.stripped.state_dict.items() if k.endswith("_cpu_int4pack")}
    assert packs and all(taken.decode.state_dict[k] is v for k, v in packs.items())
    taken.stripped.validate()


def test_the_kernel_computes_the_dequantized_linear_up_to_bf16_rounding(bf16_pair):
    taken, plain = bf16_pair
    for width, outs, _ in tm.replay_stripped({"taken": taken, "plain": plain}, [5, 1, 9], seed=7, dtype=torch.bfloat16):
        scale = outs["plain"].float().abs().max().item()
        diff = (outs["taken"].float() - outs["plain"].float()).abs().max().item()
        assert diff <= 2 ** -6 * max(scale, 1.0), (width, diff, scale)  # a few bf16 steps at the outputs' size


def test_float32_and_int8_programs_keep_their_linears():
    """The kernel is 5-14x slower than the fp32 linear in fp32 and takes int4 only."""
    ep, inputs = _program(torch.float32)
    program = run_passes(ep, inputs, CONFIG, quantize="int4", group_size=32, lowering_traces=True, cpu_int4_kernel=True)
    assert program.pass_results["cpu_int4_linear"].produced == 0 and _kernels(program.stripped) == 0
    ep, inputs = _program(torch.bfloat16)
    program = run_passes(ep, inputs, CONFIG, quantize="int8", lowering_traces=True)
    assert cpu_int4_linear(program.pass_results["strip_kv_cache"].program).produced == 0


def test_only_a_cpu_pt2_with_int4_weights_takes_the_kernel():
    assert takes_cpu_int4_kernel("pt2", "cpu", "int4", None)
    assert takes_cpu_int4_kernel("pt2", "cpu", "int8", "int4")  # an int4 lm_head
    assert not takes_cpu_int4_kernel("pt2", "cpu", "int8", None)
    assert not takes_cpu_int4_kernel("pt2", "cuda", "int4", None)
    assert not takes_cpu_int4_kernel("executorch", "cpu", "int4", None)


@pytest.fixture(scope="module")
def int4_package(tmp_path_factory):
    from tests.conftest import EXAMPLE, cli

    out = tmp_path_factory.mktemp("int4") / "int4_bf16.pt2"
    summary = json.loads(cli("export", EXAMPLE, "-o", str(out), "--dtype", "bfloat16", "--quantize", "int4",
                             "--group-size", "32", "--json").stdout)
    return out, summary


def test_a_bf16_int4_cpu_package_calls_the_kernel_without_the_stored_form_and_checks(int4_package):
    from tests.conftest import EXAMPLE, cli

    out, summary = int4_package
    assert "pass_cpu_int4_linear_s" in summary
    with zipfile.ZipFile(out) as z:
        wrappers = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
        configs = [json.loads(z.read(n)) for n in z.namelist() if n.endswith("weights_config.json")]
    assert wrappers and any("aoti_torch_cpu__weight_int4pack_mm_cpu_tensor" in w for w in wrappers)
    names = {name for config in configs for name in config}
    assert any(n.endswith("_cpu_int4pack") for n in names)
    assert not any(n.endswith((".qweight", ".scales", ".zeros")) for n in names)  # unread: not stored
    checked = cli("check", str(out), "--model", EXAMPLE)
    assert "PASSED" in checked.stdout + checked.stderr


def test_a_group_size_scalar_of_another_value_is_refused_at_load(int4_package, tmp_path):
    """The scalar AOTInductor stores for the kernel's group size (a ``constantN`` no description
    names in advance) is accepted at its export value only: the kernel reads ``K / group`` groups of
    scales and checks nothing, so a smaller one would read past them."""
    from offgraph_export.errors import ArtifactError
    from offgraph_export.runtime import Artifact
    from tests.archive_tools import rewrite

    out, _ = int4_package
    with zipfile.ZipFile(out) as z:
        config_name = next(n for n in z.namelist() if n.endswith("weights_config.json"))
        config = json.loads(z.read(config_name))
    scalars = {name: entry[0] for name, entry in config.items() if entry[1] == [] and not name.startswith("inner.")}
    assert scalars, config  # the kernel's group sizes, stored by the compiler
    files = set(scalars.values())
    def scalar_file(value: int) -> bytes:
        buffer = io.BytesIO()
        torch.save(torch.tensor(value, dtype=torch.int64), buffer)
        return buffer.getvalue()

    def with_scalar(value: int):
        return lambda name, data: scalar_file(value) if name.rsplit("/", 1)[-1] in files and "/weights/" in name else data

    Artifact.load(out)  # as exported: loads
    Artifact.load(rewrite(out, tmp_path / "same.pt2", with_scalar(32)))  # the same value written afresh: loads
    hostile = rewrite(out, tmp_path / "hostile.pt2", with_scalar(16))
    with pytest.raises(ArtifactError, match="not constants the program was compiled for"):
        Artifact.load(hostile)
