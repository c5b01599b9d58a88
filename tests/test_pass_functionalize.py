"""The functionalize pass before AOTInductor (``lowering_traces``): a program AOTInductor can trace
as it is goes on unchanged, one calling an op that trace would call by name is still decomposed,
and the program handed on computes what the functional one does (eagerly, same storage writes)."""

import pytest
import torch

from offgraph_export.ops.quantized import DECOMPOSITIONS
from offgraph_export.passes.functionalize import calls_decomposed_ops, functionalize
from offgraph_export.pipeline import run_passes
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm

CONFIG = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 5})


@pytest.fixture(scope="module")
def both():
    model = tm.Stack(3, hq=8, hkv=2, d=16, dv=8).eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0), CONFIG.max_write)
    return run_passes(ep, inputs, CONFIG), run_passes(ep, inputs, CONFIG, lowering_traces=True)


def test_a_float_program_goes_to_aotinductor_as_the_strip_pass_left_it(both):
    functional, traced_later = both
    result = traced_later.pass_results["functionalize"]
    assert result.modified is False
    assert traced_later.stripped is traced_later.pass_results["strip_kv_cache"].program
    assert functional.pass_results["functionalize"].modified is True
    # the strip pass's in-place storage writes are still in place; the functional program has none
    in_place = [str(n.target) for n in traced_later.stripped.graph.nodes if str(n.target).endswith("_.default")]
    assert in_place, "the unfunctionalized program should keep the strip pass's in-place writes"
    assert not [n for n in functional.stripped.graph.nodes if str(n.target).endswith("_.default")]
    # the signature the runtime binds to is the same either way
    assert traced_later.stripped.graph_signature.user_inputs == functional.stripped.graph_signature.user_inputs
    assert traced_later.artifact_specs("cpu").model_dump() == functional.artifact_specs("cpu").model_dump()


def test_the_program_handed_on_computes_what_the_functional_one_does(both):
    functional, traced_later = both
    programs = {"functional": functional, "traced_later": traced_later}
    for _, outs, stores in tm.replay_stripped(programs, [5, 1, 9, 1, 14], seed=5):
        torch.testing.assert_close(outs["traced_later"], outs["functional"], atol=0, rtol=0)
        for a, b in zip(stores["traced_later"].bound(), stores["functional"].bound(), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def test_a_quantized_program_is_still_decomposed_before_aotinductor():
    """``offgraph::dequantize_weight`` left in a program would be called by name from the package."""
    model = tm.Stack(2, hq=8, hkv=2, d=16, dv=8).eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0), CONFIG.max_write)
    program = run_passes(ep, inputs, CONFIG, quantize="int8", lowering_traces=True)
    before = program.pass_results["strip_kv_cache"].program
    assert calls_decomposed_ops(before)
    assert program.pass_results["functionalize"].modified is True
    assert not calls_decomposed_ops(program.stripped)
    assert not any(n.target in DECOMPOSITIONS for n in program.stripped.graph.nodes)
    # and without lowering_traces the same
    assert not calls_decomposed_ops(functionalize(before).program)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_program_before_aotinductor_is_spliced_not_retraced(scheme):
    """Before AOTInductor the dequantized weights' calls are replaced in place by their aten nodes
    (``graph_utils.inline_calls``) instead of re-tracing the program: the strip pass's program
    stays as it was (the decode method is traced again from it), its in-place storage writes stay
    (as a float program's do), the signature is the same, and the program computes, bit for bit,
    what the re-traced functional one does."""
    model = tm.Stack(2, hq=8, hkv=2, d=16, dv=8).eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0), CONFIG.max_write)
    kwargs = {"quantize": scheme, "group_size": 32 if scheme == "int4" else None}
    spliced = run_passes(ep, inputs, CONFIG, lowering_traces=True, **kwargs)
    functional = run_passes(ep, inputs, CONFIG, **kwargs)
    before = spliced.pass_results["strip_kv_cache"].program
    assert calls_decomposed_ops(before), "the strip pass's own program must keep its calls"
    assert spliced.stripped is not before and not calls_decomposed_ops(spliced.stripped)
    assert [str(n.target) for n in spliced.stripped.graph.nodes if str(n.target).endswith("_.default")]
    assert spliced.stripped.graph_signature.user_inputs == functional.stripped.graph_signature.user_inputs
    assert spliced.stripped.graph_signature.buffers_to_mutate == before.graph_signature.buffers_to_mutate
    for _, outs, _ in tm.replay_stripped({"functional": functional, "spliced": spliced}, [5, 1, 9], seed=6):
        torch.testing.assert_close(outs["spliced"], outs["functional"], atol=0, rtol=0)
