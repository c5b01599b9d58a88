"""Record the bound of integer inputs that index a table, and keep the compiled lookup in bounds.

A token id outside the vocabulary fails only inside the compiled program: on a GPU as a device-side
assert, which takes down every session of the process. This pass finds each user input that is,
through shape-only ops, the index argument of an embedding lookup, records ``table rows`` as its
bound (values must lie in ``[0, bound)``; the runtime refuses host tensors outside it before launch)
and clamps the indices into that range inside the graph, so a bad id that reaches the program
anyway (a device tensor the runtime does not read) cannot read out of bounds. For ids inside the
range the clamp is the identity.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from offgraph_export.passes.result import PassResult
from offgraph_export.passes.value_flow import source_user_input

__all__ = ["bound_table_indices"]

_aten = torch.ops.aten


def bound_table_indices(ep: ExportedProgram) -> PassResult[dict[int, int]]:
    """Produce ``{input index: bound}``; ``modified`` when a clamp was inserted."""
    bounds: dict[int, int] = {}
    graph = ep.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != _aten.embedding.default:
            continue
        weight, indices = node.args[0], node.args[1]
        source = source_user_input(ep, indices)
        rows = weight.meta["val"].shape[0] if hasattr(weight, "meta") and "val" in weight.meta else None
        if source is None or not isinstance(rows, int):
            continue
        bounds[source] = min(bounds.get(source, rows), rows)
        with graph.inserting_before(node):
            clamped = graph.call_function(_aten.clamp.default, (indices, 0, rows - 1))
        clamped.meta["val"] = indices.meta.get("val")
        node.replace_input_with(indices, clamped)
    if bounds:
        ep.graph_module.recompile()
    return PassResult(ep, modified=bool(bounds), produced=bounds)
