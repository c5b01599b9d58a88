"""Make the batched artifact's sessions method: every paged attention call takes one row per session.

Why: in a decode step of several sessions every token is its session's only new row, so no token
reads a row another token of the step writes, and the paged step can take the one-token step's
form at any width (``paged_attend.paged_step(one_row_per_session=True)``, design section 10): the
row writes folded into the attention kernel, q/k/v read where they lie, the rotary embedding
applied in the kernel with one row per token. The general program cannot assume it (a prefill
chunk's tokens read each other's rows), so the batched runner sends decode-only steps of width
>= 2 to a method of their own, this pass's program. Measured per layer (Llama-3.2-1B attention
shape, H100, ``scripts/sweep_paged_attention.py --fold``): 28.9 -> 21.4 us at 16 sessions of 1k
history, 63.6 -> 54.2 us at 64, the model's rotary kernels not counted.

What it does to its program (a re-trace of the stripped program, ``specialize_width(width=None)``,
before ``functionalize``), for every ``offgraph_lowered::triton_paged_update_and_attend`` call:

1. ``one_row_per_session=True``;
2. the query's and key's rotary embedding folded into the call with one row per token where the
   model's pattern matches (:func:`~offgraph_export.passes.decode_rope.fold_rope`);
3. what the kernels now read in place gets a layout the graph fixes: q, k and v must each be a
   chain of views of a matmul's output, of a graph input or of a dense copy, since the kernels'
   strides are numbers taken when the op is traced and AOTInductor lays out other values as it
   chooses (the reason the general step copies them, ``kernels/triton_attend.py``); any other gets
   a dense copy before the call. The rotary rows get one dense copy each, shared by the calls.

Produces the number of calls rewritten (0 for a portable program: its steps are aten ops).
"""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram

from offgraph_export.passes.decode_rope import fold_rope, is_rotary_row
from offgraph_export.passes.graph_utils import drop_dead, is_call, op_arguments, replace_op_arguments, tensor_value
from offgraph_export.passes.result import PassResult

__all__ = ["decode_sessions"]

aten = torch.ops.aten

#: ops whose output is a view of their first argument (a layout the argument's fixes)
_VIEWS = (
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
    aten.alias.default,
)
#: ops that split their first argument into views (read through ``getitem``)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
#: ops whose output layout the compiler does not choose: a matmul's output is a row-major buffer
_FIXED = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default)
_TO_DTYPE = (aten.to.dtype, aten.to.dtype_layout, aten.to.device)


def _is_dense_copy(node: torch.fx.Node) -> bool:
    """A copy into the contiguous layout of its shape (``kernels.portable.dense_copy``)."""
    return is_call(node, aten._to_copy.default) and node.kwargs.get("memory_format") is torch.contiguous_format


def has_fixed_layout(node: object) -> bool:
    """Whether ``node``'s layout is fixed by the graph: a chain of views (and same-dtype ``to``
    calls, which return their input) from a matmul's output, a graph input or a dense copy."""
    while isinstance(node, torch.fx.Node):
        if node.op == "placeholder" or _is_dense_copy(node) or any(is_call(node, op) for op in _FIXED):
            return True
        if any(is_call(node, op) for op in _VIEWS):
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and any(is_call(node.args[0], op) for op in _SPLITS):
            node = node.args[0].args[0]
        elif any(is_call(node, op) for op in _TO_DTYPE):
            value, source = tensor_value(node), tensor_value(node.args[0])
            if value is None or source is None or value.dtype != source.dtype or value.device != source.device:
                return False
            node = node.args[0]
        else:
            return False
    return False


def _dense_copy_node(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    """A dense copy of ``x`` (inserted at the graph's current insertion point), its value
    traced by the program's fake mode."""
    value = tensor_value(x)
    copy = graph.call_function(aten._to_copy.default, (x,), {"dtype": value.dtype, "memory_format": torch.contiguous_format})
    fake_mode = torch._guards.detect_fake_mode([value])
    with fake_mode if fake_mode is not None else torch.no_grad():
        copy.meta["val"] = aten._to_copy.default(value, dtype=value.dtype, memory_format=torch.contiguous_format)
    return copy


def _rows_source(rows: torch.fx.Node, q: torch.Tensor) -> torch.fx.Node:
    """The node the rotary rows are views of while they stay rows (transformers' Llama takes
    ``cos.unsqueeze(1)`` in every layer of the step's one ``cos``): one copy of it serves every
    layer, where a copy of each layer's view would be two kernels a layer."""
    while any(is_call(rows, op) for op in _VIEWS[:2] + (aten.unsqueeze.default, aten.squeeze.dim)):
        source = rows.args[0]
        if not is_rotary_row(source, q, per_token=True):
            break
        rows = source
    return rows


def decode_sessions(ep: ExportedProgram) -> PassResult[int]:
    """Rewrite every paged attention call of ``ep`` (in place) to its one-row-per-session form;
    see the module docstring. Produces how many calls were rewritten."""
    import offgraph_export.kernels.paged_attend  # noqa: F401  (defines the paged op)

    paged = torch.ops.offgraph_lowered.triton_paged_update_and_attend.default
    graph = ep.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rows_copies: dict[torch.fx.Node, torch.fx.Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        if not is_call(node, paged):
            continue
        replace_op_arguments(node, one_row_per_session=True)
        fold_rope(node, order, per_token=True)
        args = op_arguments(node)
        copies = {}
        with graph.inserting_before(node):
            for name in ("q", "k", "v"):
                if not has_fixed_layout(args[name]):
                    copies[name] = _dense_copy_node(graph, args[name])
        for name in ("rope_cos", "rope_sin"):
            rows = args.get(name)
            if rows is None:
                continue
            rows = _rows_source(rows, tensor_value(args["q"]))
            if rows not in rows_copies:
                with graph.inserting_after(rows):
                    rows_copies[rows] = _dense_copy_node(graph, rows)
            copies[name] = rows_copies[rows]
        if copies:
            replace_op_arguments(node, **copies)
        rewritten += 1
    if rewritten:
        drop_dead(graph)
        graph.lint()
        ep.graph_module.recompile()
    return PassResult(ep, modified=bool(rewritten), produced=rewritten)
