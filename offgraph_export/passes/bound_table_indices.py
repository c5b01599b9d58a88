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
    """Produce ``{input index: bound}``; ``modified`` when a clamp was inserted. Runs again on its
    own output record the same bounds and insert nothing."""
    bounds: dict[int, int] = {}
    inserted = 0
    graph = ep.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != _aten.embedding.default:
            continue
        weight, indices = node.args[0], node.args[1]
        rows = weight.meta["val"].shape[0] if hasattr(weight, "meta") and "val" in weight.meta else None
        if not isinstance(rows, int):
            continue
        inner = _own_clamp(indices, rows)
        source = source_user_input(ep, inner if inner is not None else indices)
        if source is None:
            continue
        bounds[source] = min(bounds.get(source, rows), rows)
        if inner is not None:
            continue  # clamped by an earlier run of this pass on the same program
        with graph.inserting_before(node):
            clamped = graph.call_function(_aten.clamp.default, (indices, 0, rows - 1))
        clamped.meta["val"] = indices.meta.get("val")
        node.replace_input_with(indices, clamped)
        inserted += 1
    if inserted:
        ep.graph_module.recompile()
    return PassResult(ep, modified=bool(inserted), produced=bounds)


def _own_clamp(indices: object, rows: int) -> object:
    """The clamped node when ``indices`` is the clamp this pass inserts for a table of ``rows``
    (so a second run on the same program records the same bound and adds no second clamp)."""
    if (
        isinstance(indices, torch.fx.Node)
        and indices.op == "call_function"
        and indices.target == _aten.clamp.default
        and tuple(indices.args[1:]) == (0, rows - 1)
    ):
        return indices.args[0]
    return None
