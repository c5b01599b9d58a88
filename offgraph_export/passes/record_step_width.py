"""Record which program input carries the step's token width, as ``"input_index:dim"``.

After lowering, the runtime cannot see inside the program; it must learn from the step's inputs
alone how many rows the step writes. Every cache op writes ``k.shape[2]`` tokens; that extent is a
symbol of the exported program's shape environment. We follow it back to the first user input
whose shape carries the same symbol: that input's index and dim are the spec.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.passes.graph_utils import size_expr, user_input_nodes
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.passes.result import PassResult
from offgraph_export.specs.step_width import StepWidthSpec

__all__ = ["record_step_width"]


def record_step_width(ep: ExportedProgram) -> PassResult[StepWidthSpec]:
    """Produce the spec; the graph is left alone."""
    sites = find_kv_sites(ep.graph)
    if not sites:
        raise ExportError("no KV op in the graph: there is no step width to record")
    widths = {site.node.name: site.val("k").shape[2] for site in sites}
    exprs = {name: size_expr(w) for name, w in widths.items()}
    if len({str(e) for e in exprs.values()}) != 1:
        listing = ", ".join(f"{name} writes {w}" for name, w in exprs.items())
        raise ExportError(f"KV ops write different token widths: {listing}")
    width = next(iter(exprs.values()))
    if isinstance(width, int):
        raise ExportError(
            f"the token width is the constant {width} in the traced graph (nodes "
            f"{', '.join(exprs)}): export with a dynamic token dimension so one program serves "
            "every step width"
        )
    for index, node in enumerate(user_input_nodes(ep)):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if size_expr(size) == width:
                return PassResult(ep, modified=False, produced=StepWidthSpec(input_index=index, dim=dim))
    raise ExportError(
        f"no model input carries the token width {width} written by nodes {', '.join(exprs)}; "
        "the width must be the extent of some input (tokens [B,T], embeddings [B,T,H], positions [T])"
    )
