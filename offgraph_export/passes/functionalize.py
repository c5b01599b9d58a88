"""Functionalize the stripped program: its in-place storage writes become declared user-input
mutations, and ``triton_op`` steps are decomposed into their kernels (export keeps them as opaque
custom ops by default) so that AOTInductor compiles the kernels into the package instead of calling
the op by name; what is left of ``offgraph::dequantize_weight`` (quantized linears no kernel took
over) becomes its aten form for the same reason."""

from __future__ import annotations

from torch.export import ExportedProgram

from offgraph_export.compat import decompose
from offgraph_export.ops.quantized import DECOMPOSITIONS
from offgraph_export.passes.result import PassResult

__all__ = ["functionalize"]


def functionalize(ep: ExportedProgram) -> PassResult[None]:
    """``modified`` says whether the graph's code changed."""
    out = decompose(ep, DECOMPOSITIONS)
    return PassResult(out, modified=out.graph_module.code != ep.graph_module.code, produced=None)
