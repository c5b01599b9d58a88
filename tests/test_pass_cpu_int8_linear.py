"""The cpu int8 kernel pass (``passes/cpu_int8_linear.py``): a bf16 program's int8 linears become
``aten._weight_int8pack_mm`` (general and decode methods), every other linear stays, the program
it was given is left as it was, and the rewritten program computes what the dequantize + linear
program does up to bf16 rounding; an export for cpu compiles the kernel into the package, which
checks against its eager oracle."""

import json

import pytest
import torch

from offgraph_export.passes.cpu_int8_linear import cpu_int8_linear
from offgraph_export.pipeline import run_passes, takes_cpu_int8_kernel
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm

CONFIG = CacheConfig(**tm.QUANT_CACHE)
KERNEL = "aten._weight_int8pack_mm.default"


def _program(dtype):
    return tm.quantizable_program(dtype)


def _kernels(ep):
    return tm.count_calls(ep, KERNEL)


@pytest.fixture(scope="module")
def bf16_pair():
    ep, inputs = _program(torch.bfloat16)
    common = dict(quantize="int8", lowering_traces=True, decode_method=True)
    return run_passes(ep, inputs, CONFIG, cpu_int8_kernel=True, **common), run_passes(ep, inputs, CONFIG, **common)


def test_every_int8_linear_of_both_methods_takes_the_kernel(bf16_pair):
    taken, plain = bf16_pair
    linears = sum(str(n.target) == "aten.linear.default" for n in plain.stripped.graph.nodes)
    assert linears > 0
    assert taken.pass_results["cpu_int8_linear"].produced == linears == _kernels(taken.stripped)
    assert not any(str(n.target) == "aten.linear.default" for n in taken.stripped.graph.nodes)
    assert taken.pass_results["cpu_int8_linear_decode"].produced == _kernels(taken.decode) > 0
    # the strip pass's own program keeps its linears: the decode method is traced from it again
    assert _kernels(taken.pass_results["strip_kv_cache"].program) == 0
    assert taken.stripped.graph_signature.user_inputs == plain.stripped.graph_signature.user_inputs


def test_the_kernel_computes_the_dequantized_linear_up_to_bf16_rounding(bf16_pair):
    taken, plain = bf16_pair
    for width, outs, _ in tm.replay_stripped({"taken": taken, "plain": plain}, [5, 1, 9], seed=7, dtype=torch.bfloat16):
        scale = outs["plain"].float().abs().max().item()
        diff = (outs["taken"].float() - outs["plain"].float()).abs().max().item()
        assert diff <= 2 ** -6 * max(scale, 1.0), (width, diff, scale)  # a few bf16 steps at the outputs' size


def test_float32_and_int4_programs_keep_their_linears():
    """The kernel has no fp32 fast path (slower than the fp32 linear) and takes int8 only."""
    ep, inputs = _program(torch.float32)
    program = run_passes(ep, inputs, CONFIG, quantize="int8", lowering_traces=True, cpu_int8_kernel=True)
    assert program.pass_results["cpu_int8_linear"].produced == 0 and _kernels(program.stripped) == 0
    ep, inputs = _program(torch.bfloat16)
    program = run_passes(ep, inputs, CONFIG, quantize="int4", group_size=32, lowering_traces=True)
    assert cpu_int8_linear(program.pass_results["strip_kv_cache"].program).produced == 0


def test_only_a_cpu_pt2_with_int8_weights_takes_the_kernel():
    assert takes_cpu_int8_kernel("pt2", "cpu", "int8", None)
    assert takes_cpu_int8_kernel("pt2", "cpu", "int4", "int8")  # an int8 lm_head
    assert not takes_cpu_int8_kernel("pt2", "cpu", "int4", None)
    assert not takes_cpu_int8_kernel("pt2", "cuda", "int8", None)
    assert not takes_cpu_int8_kernel("executorch", "cpu", "int8", None)


def test_a_bf16_int8_cpu_package_calls_the_kernel_and_checks(tmp_path):
    import zipfile

    from tests.conftest import EXAMPLE, cli

    out = tmp_path / "int8_bf16.pt2"
    summary = json.loads(cli("export", EXAMPLE, "-o", str(out), "--dtype", "bfloat16", "--quantize", "int8", "--json").stdout)
    assert "pass_cpu_int8_linear_s" in summary
    with zipfile.ZipFile(out) as z:
        wrappers = [z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")]
    assert wrappers and any("aoti_torch_cpu__weight_int8pack_mm" in w for w in wrappers)
    checked = cli("check", str(out), "--model", EXAMPLE)
    assert "PASSED" in checked.stdout + checked.stderr
    # and from Python, the model named by reference: cast to the specs' bfloat16 as the CLI does
    from offgraph_export.check import check_artifact

    report = check_artifact(str(out), EXAMPLE)
    assert report.passed, report.render()


def test_a_biased_linear_over_a_symbolic_width_keeps_its_bias():
    """``linear(x, W', b)`` with ``x`` ``[1, T, K]``, T symbolic: the kernel, a view back to
    ``[1, T, N]`` and the bias added; the same values as the linear over ``W'`` up to bf16 rounding."""
    from offgraph_export.ops.quantized import dequantize_weight
    from offgraph_export.reference.weight_quant import quantize

    stored = quantize(torch.randn(24, 32) * 0.1, "int8")

    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("q", stored.qweight)
            self.register_buffer("s", stored.scales.to(torch.bfloat16))
            self.b = torch.nn.Parameter(torch.randn(24, dtype=torch.bfloat16))

        def forward(self, x):
            w = dequantize_weight(self.q, self.s, None, 0, torch.bfloat16)
            return torch.nn.functional.linear(x, w, self.b)

    x = torch.randn(1, 6, 32, dtype=torch.bfloat16)
    ep = torch.export.export(Biased(), (x,), dynamic_shapes=({1: torch.export.Dim("t", min=1, max=64)},))
    result = cpu_int8_linear(ep)
    assert result.produced == 1 and _kernels(result.program) == 1 and _kernels(ep) == 0
    for width in (1, 6, 17):
        xs = torch.randn(1, width, 32, dtype=torch.bfloat16)
        got, want = result.program.module()(xs), ep.module()(xs)
        assert got.shape == want.shape == (1, width, 24)
        assert (got.float() - want.float()).abs().max() <= 2 ** -6 * max(want.float().abs().max().item(), 1.0)
