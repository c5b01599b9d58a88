"""Rewrite every split of a tensor into one slice per piece.

Why: ExecuTorch's edge dialect turns ``split``/``split_with_sizes``/``chunk`` (the fused
projections' split, the ``chunk`` in a rotary embedding) into ``split_copy``, for which
ExecuTorch's CUDA backend has no kernel (seen with executorch 1.2.0: "missing fallback kernels:
aten::split_copy.Tensor"), while ``slice`` becomes ``slice_copy``, which it compiles. Each
``getitem(split(x, ...), i)`` becomes ``slice(x, dim, start_i, end_i)``: the same values, one node
per piece. Splits along a dim of symbolic size, or of size 0, are left alone. Produces how many
splits it rewrote."""

from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram

from offgraph_export.passes.graph_utils import replace_node
from offgraph_export.passes.result import PassResult

__all__ = ["split_to_slices"]

aten = torch.ops.aten
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _bounds(node: torch.fx.Node) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each piece of a split node with static sizes, else None."""
    x = node.args[0]
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if not isinstance(value, torch.Tensor) or not isinstance(dim, int):
        return None
    extent = value.shape[dim]
    if not isinstance(extent, int) or extent == 0:
        return None  # symbolic bounds; an empty dim splits into one empty piece
    if node.target is aten.split_with_sizes.default:
        sizes = list(node.args[1])
    else:
        size = node.args[1]
        if not isinstance(size, int) or size <= 0:
            return None
        if node.target is aten.chunk.default:  # `size` chunks of ceil(extent / size) elements
            size = -(-extent // size)
        sizes = [min(size, extent - s) for s in range(0, extent, size)]
    if not all(isinstance(s, int) for s in sizes) or sum(sizes) != extent:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def split_to_slices(ep: ExportedProgram) -> PassResult[int]:
    """Rewrite ``ep``'s splits (in place) into slices; see the module docstring."""
    graph = ep.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SPLITS:
            continue
        bounds = _bounds(node)
        if bounds is None or any(u.target is not operator.getitem for u in node.users):
            continue
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        for item in list(node.users):
            start, end = bounds[item.args[1]]
            with graph.inserting_before(item):
                piece = graph.call_function(aten.slice.Tensor, (node.args[0], dim, start, end))
            piece.meta = dict(item.meta)
            replace_node(ep, item, piece)
            graph.erase_node(item)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
        ep.graph_module.recompile()
    return PassResult(ep, modified=bool(rewritten), produced=rewritten)
