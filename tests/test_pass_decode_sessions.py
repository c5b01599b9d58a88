"""The sessions method's rewrite (``passes/decode_sessions.py``), pinned on the traced graphs of a
batched triton program (traced on the cpu: fake tensors, nothing runs): every paged attention
call takes one row per session; q/k/v read in place are views of a matmul's output or dense
copies; transformers' Llama rotary embedding goes into the call with one row per token, its rows
copied once for every layer; the decomposed program launches no row-write kernel."""

from __future__ import annotations

import operator

import pytest
import torch

pytest.importorskip("triton")

from offgraph_export.frontends import load_bundle  # noqa: E402
from offgraph_export.passes.decode_sessions import decode_sessions, has_fixed_layout  # noqa: E402
from offgraph_export.passes.functionalize import functionalize  # noqa: E402
from offgraph_export.passes.graph_utils import op_arguments  # noqa: E402
from offgraph_export.passes.specialize_width import specialize_width  # noqa: E402
from offgraph_export.pipeline import export_model, run_passes  # noqa: E402
from tests.conftest import EXAMPLE  # noqa: E402

aten = torch.ops.aten


def _sessions_program(reference: str):
    bundle = load_bundle(reference)
    config = bundle.cache_config.model_copy(update=dict(max_sessions=4, page_size=4))
    inputs = tuple(x.narrow(d, 0, min(x.shape[d], config.max_write)) if d is not None else x
                   for x, d in zip(bundle.example_inputs, bundle.token_dims))
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, config.max_write)
    program = run_passes(ep, inputs, config, "triton")
    stripped = program.pass_results["strip_kv_cache"].program
    general_calls = [n for n in stripped.graph.nodes if "paged_update_and_attend" in str(n.target)]
    retraced = specialize_width(stripped, program.step_width, width=None).program
    return general_calls, decode_sessions(retraced)


def _calls(ep):
    return [n for n in ep.graph.nodes if "paged_update_and_attend" in str(n.target)]


def _kernels(ep) -> list[str]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
            for n in ep.graph.nodes if "triton_kernel_wrapper" in str(n.target)]


def test_the_example_copies_its_computed_q_and_k_and_reads_v_in_place():
    general, result = _sessions_program(EXAMPLE)
    calls = _calls(result.program)
    assert result.produced == 2 and len(calls) == 2
    assert all("one_row_per_session" not in n.kwargs for n in general)  # the general program is untouched
    for call in calls:
        args = op_arguments(call)
        assert args["one_row_per_session"] is True and args.get("rope_cos") is None  # its rotary form is not Llama's
        for name in ("q", "k"):  # rotated by the model's own code: computed, so copied
            assert args[name].target is aten._to_copy.default and args[name].kwargs["memory_format"] is torch.contiguous_format
        assert args["v"].target is aten.transpose.int and has_fixed_layout(args["v"])  # a view of the fused projection
    kernels = _kernels(functionalize(result.program).program)
    assert "_paged_write_kernel" not in kernels and kernels.count("_paged_attend_kernel") == 2, kernels


def test_llama_rotary_goes_into_the_call_with_one_row_per_token(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.test_frontend_hf import COMMON

    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    _, result = _sessions_program(f"hf:{tmp_path}")
    calls = _calls(result.program)
    assert result.produced == 3 and len(calls) == 3
    rows = set()
    for call in calls:
        args = op_arguments(call)
        assert args["one_row_per_session"] is True
        for name in ("q", "k", "v"):  # unrotated views of the q|k|v projection: read in place
            assert args[name].target is aten.transpose.int and has_fixed_layout(args[name]), name
        for name in ("rope_cos", "rope_sin"):
            assert args[name].target is aten._to_copy.default
            value = args[name].meta["val"]
            assert value.shape[-1] == COMMON["head_dim"] and str(value.shape[-2]) == str(args["q"].meta["val"].shape[2])
        rows.add((args["rope_cos"], args["rope_sin"]))
    assert len(rows) == 1  # one copy of the step's rows serves every layer
    assert not any(n.target is aten.neg.default for n in result.program.graph.nodes)  # no rotary left in the graph
    kernels = _kernels(functionalize(result.program).program)
    assert "_paged_write_kernel" not in kernels and kernels.count("_paged_attend_kernel") == 3, kernels


def test_fixed_layout_is_a_view_chain_to_a_matmul_an_input_or_a_dense_copy():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    mm = graph.call_function(aten.mm.default, (x, w))
    view = graph.call_function(aten.view.default, (mm, [1, 2, 3]))
    parts = graph.call_function(aten.split_with_sizes.default, (view, [1, 2], -1))
    piece = graph.call_function(operator.getitem, (parts, 0))
    moved = graph.call_function(aten.transpose.int, (piece, 1, 2))
    computed = graph.call_function(aten.mul.Tensor, (moved, 2.0))
    copied = graph.call_function(aten._to_copy.default, (computed,), {"memory_format": torch.contiguous_format})
    other_copy = graph.call_function(aten._to_copy.default, (computed,), {"dtype": torch.float16})
    assert has_fixed_layout(moved) and has_fixed_layout(x) and has_fixed_layout(copied)
    assert not has_fixed_layout(computed) and not has_fixed_layout(other_copy)
    assert not has_fixed_layout(graph.call_function(aten.transpose.int, (computed, 0, 1)))
