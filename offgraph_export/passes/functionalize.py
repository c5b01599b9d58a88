"""Functionalize the stripped program: its in-place storage writes become declared user-input
mutations, and ``triton_op`` steps are decomposed into their kernels (export keeps them as opaque
custom ops by default) so that a lowering compiles the kernels instead of calling the op by name;
what is left of ``offgraph::dequantize_weight`` (quantized linears no kernel took over) becomes its
aten form for the same reason.

Before AOTInductor (``lowering_traces``) most of that is done twice: AOTInductor traces every
program again itself (aot_autograd, outside export, where torch decomposes ``triton_op`` calls
into their kernels and functionalizes in-place writes), so the pass decomposes here only what that
trace would call by name: :data:`~offgraph_export.ops.quantized.DECOMPOSITIONS`. A program with
none is handed on as it is. On the dev CPU that saved the whole pass (17.8 s of the 119 s export
of SmolLM2-135M) and 2 s of AOTInductor's own trace. A program with some (a quantized model's
general method, whose weights no decode GEMV took) has each call replaced by its aten nodes in
place (:func:`~offgraph_export.passes.graph_utils.inline_calls`), not by a re-trace of the whole
program: the 1B int4 program's pass took 12.6 s on the dev CPU that way round (25 s beside two
other builds on the H100 machine's host).
"""

from __future__ import annotations

from torch.export import ExportedProgram

from offgraph_export.compat import decompose
from offgraph_export.ops.quantized import DECOMPOSITIONS
from offgraph_export.passes.graph_utils import inline_calls
from offgraph_export.passes.result import PassResult

__all__ = ["calls_decomposed_ops", "functionalize"]


def calls_decomposed_ops(ep: ExportedProgram) -> bool:
    """Whether ``ep`` calls an op of :data:`DECOMPOSITIONS`, which a lowering would otherwise call by name."""
    return any(node.op == "call_function" and node.target in DECOMPOSITIONS for node in ep.graph.nodes)


def functionalize(ep: ExportedProgram, lowering_traces: bool = False) -> PassResult[None]:
    """``modified`` says whether the graph's code changed. ``lowering_traces``: the program goes
    to a lowering that functionalizes and decomposes ``triton_op`` calls in its own trace
    (AOTInductor), so only :data:`DECOMPOSITIONS` ops are decomposed here, in place of their calls
    (a copy of ``ep``), and a program with none is returned unchanged."""
    given = ep
    if lowering_traces:
        ep, replaced = inline_calls(ep, DECOMPOSITIONS)
        if not calls_decomposed_ops(ep):  # none left (a call that did not splice is decomposed below)
            return PassResult(ep, modified=bool(replaced), produced=None)
    out = decompose(ep, DECOMPOSITIONS)
    return PassResult(out, modified=out.graph_module.code != given.graph_module.code, produced=None)
