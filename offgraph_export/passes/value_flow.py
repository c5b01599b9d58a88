"""Following a value back to the user input it comes from through ops that only change its shape
(views, reshapes, squeezes, copies, and expands that repeat nothing), for the passes that give
inputs a role. An expand that broadcasts a dim repeats values: a one-entry position broadcast to
every token is not a per-token position, so the flow stops there."""

from __future__ import annotations

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import statically_known_true

from offgraph_export.passes.graph_utils import user_input_nodes

__all__ = ["source_user_input"]

_aten = torch.ops.aten
#: Ops whose output holds the same values as their first argument, in the same order.
_SHAPE_ONLY = {
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
    _aten.unsqueeze.default, _aten.squeeze.default, _aten.squeeze.dim, _aten.squeeze.dims,
    _aten.flatten.using_ints, _aten.clone.default, _aten.alias.default, _aten.contiguous.default,
    _aten.expand.default, _aten.detach.default,
}


def _repeats(node: fx.Node) -> bool:
    """Whether ``node`` (an expand) may repeat its input's values: it adds dims, or a dim's size
    is not known to stay what it was. Unknown shapes count as repeating."""
    if node.target != _aten.expand.default:
        return False
    source, out = getattr(node.args[0], "meta", {}).get("val"), node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor) or source.dim() != out.dim():
        return True
    return not all(statically_known_true(a == b) for a, b in zip(source.shape, out.shape))


def source_user_input(ep: ExportedProgram, value: object) -> int | None:
    """The index of the user input ``value`` is a reshaped copy of, or None."""
    index = {node: i for i, node in enumerate(user_input_nodes(ep))}
    node = value
    while isinstance(node, fx.Node):
        if node in index:
            return index[node]
        if node.op != "call_function" or node.target not in _SHAPE_ONLY or not node.args or _repeats(node):
            return None
        node = node.args[0]
    return None
