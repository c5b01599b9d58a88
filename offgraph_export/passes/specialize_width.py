"""Specialize the stripped program to a fixed token width: the decode method.

Why: the stripped program serves every width in ``[1, max_write]``, so the compiler must emit
shape-generic kernels (GEMMs with a symbolic M, attention grids that choose a variant at run time).
Nearly every step of generation writes one token. A second program traced with the width fixed at
1 lets AOTInductor specialize its kernels for that one shape (GEMV-shaped GEMMs, which max-autotune
can then tune; the attention op takes its one-token path), while the general program keeps serving
prefill. Both are the same graph: this pass re-traces the stripped program's own module, so the two
methods compute the same function and share the same weight tensors (the packager stores them once).

Only the width symbol is fixed; every other dynamic dim (the flat storage's row count above all)
stays dynamic with its range, so the runtime binds the same growing storage to either method.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.passes.graph_utils import describe_inputs, input_dynamic_shapes, size_expr, user_input_nodes
from offgraph_export.passes.result import PassResult
from offgraph_export.specs.step_width import StepWidthSpec

__all__ = ["specialize_width"]


def _narrowed(example: torch.Tensor, node: torch.fx.Node, symbol: str, width: int) -> torch.Tensor:
    """``example`` cut to ``width`` along every dim that carries the width ``symbol``."""
    for dim, size in enumerate(node.meta["val"].shape):
        if isinstance(size, torch.SymInt) and str(size_expr(size)) == symbol:
            example = example.narrow(dim, 0, width)
    # A copy in the one contiguous layout of its shape: the compiled method takes the example's
    # strides as its own, and a narrowed view keeps the wide example's stride on a dim of size 1
    # (``.contiguous()`` returns such a view as it is), which no caller's tensor has.
    return example.clone(memory_format=torch.contiguous_format)


def specialize_width(stripped: ExportedProgram, step_width: StepWidthSpec, width: int | None = 1) -> PassResult[str]:
    """Return ``stripped`` re-traced with the token width fixed at ``width``; storage rows stay
    dynamic. The examples are the stripped program's own, cut to ``width``. Produces the width
    symbol that was fixed. The inputs keep their names and order. ``width`` None: re-traced with
    every dim as it was (a program of its own, sharing the weights, for a pass to rewrite: the
    batched artifact's sessions method, ``passes/decode_sessions.py``)."""
    nodes = user_input_nodes(stripped)
    symbol = str(size_expr(nodes[step_width.input_index].meta["val"].shape[step_width.dim]))
    if symbol.isdigit():
        raise ExportError(f"the step width {step_width.format()!r} is already the constant {symbol}")
    if stripped.example_inputs is None:
        raise ExportError("the stripped program carries no example inputs to trace the decode method with")
    args, _ = stripped.example_inputs
    shapes = input_dynamic_shapes(stripped)
    if width is None:
        examples = tuple(x.clone(memory_format=torch.contiguous_format) for x in args)
    else:
        for node, spec in zip(nodes, shapes):
            for dim, size in enumerate(node.meta["val"].shape):
                if isinstance(size, torch.SymInt) and str(size_expr(size)) == symbol:
                    del spec[dim]
        examples = tuple(_narrowed(x, node, symbol, width) for x, node in zip(args, nodes))
    try:
        ep = torch.export.export(stripped.module(), examples, dynamic_shapes=tuple(shapes), strict=False)
    except Exception as exc:  # export raises many types; keep the cause chained
        raise ExportError(f"tracing the {_label(width)} method failed: {exc}") from exc
    names = list(stripped.graph_signature.user_inputs)
    got = list(ep.graph_signature.user_inputs)
    if got != names:
        raise ExportError(f"the {_label(width)} method takes inputs {got}, expected {names}")
    _check_same_inputs(stripped, ep, symbol, width)
    return PassResult(ep, modified=True, produced=symbol)


def _label(width: int | None) -> str:
    return f"width-{width}" if width is not None else "re-traced"


def _check_same_inputs(general: ExportedProgram, fixed: ExportedProgram, symbol: str, width: int | None) -> None:
    """The re-traced program takes what the general one takes with the width at ``width``: same
    dtypes and static sizes, and every other dynamic dim dynamic with the same range (symbols
    may be renamed, consistently). The specs describe the decode method by this rule, so it must
    hold of the traced program, not only of the description."""
    n = len(general.graph_signature.user_inputs)
    want, want_symbols = describe_inputs(general, n)
    have, have_symbols = describe_inputs(fixed, n)
    renamed: dict[str, str] = {}
    for a, b in zip(want, have):
        problem = None
        if a.dtype != b.dtype or len(a.shape) != len(b.shape):
            problem = f"{b.dtype} {b.shape} where the general step takes {a.dtype} {a.shape}"
        for x, y in zip(a.shape, b.shape):
            if problem:
                break
            if x == symbol and width is not None:
                ok = y == width
            elif isinstance(x, int):
                ok = x == y
            else:
                ok = isinstance(y, str) and renamed.setdefault(x, y) == y and want_symbols[x] == have_symbols[y]
            if not ok:
                problem = f"shape {b.shape} where the general step takes {a.shape} ({symbol} = {width})"
        if problem:
            raise ExportError(f"the {_label(width)} method's input {a.name!r} is {problem}")
    if len(set(renamed.values())) != len(renamed):
        raise ExportError(f"the {_label(width)} method merged dynamic sizes the general step keeps apart: {renamed}")
