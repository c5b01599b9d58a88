"""Graph helpers used by several passes and by the pipeline: the user-input placeholders, the
symbols of their dynamic dims and those symbols' ranges."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from offgraph_export.compat import dynamic_dim
from offgraph_export.errors import ExportError
from offgraph_export.specs.artifact import InputSpec, SymbolRange

__all__ = [
    "user_input_nodes",
    "size_expr",
    "symbol_range",
    "input_dynamic_shapes",
    "describe_inputs",
]


def user_input_nodes(ep: ExportedProgram) -> list[torch.fx.Node]:
    """Placeholders of the user inputs, in the order the runtime passes them."""
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [by_name[name] for name in ep.graph_signature.user_inputs]


def size_expr(size: object) -> object:
    """The sympy expression of a symbolic size, or the int itself."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def symbol_range(ep: ExportedProgram, expr: object) -> tuple[int, int | None]:
    """``(min, max)`` of a dynamic dim's symbol (``max`` None when unbounded)."""
    rng = ep.range_constraints.get(expr)  # type: ignore[call-overload]
    if rng is None:
        raise ExportError(f"the program has no range for the size {expr}")
    return int(rng.lower), (int(rng.upper) if rng.upper.is_finite else None)


def input_dynamic_shapes(ep: ExportedProgram) -> list[dict[int, object]]:
    """``dynamic_shapes`` for the user inputs, rebuilt from the program's own symbols: one hint per
    symbol, so dims that shared a symbol share a hint again."""
    hints: dict[str, object] = {}
    shapes = []
    for node in user_input_nodes(ep):
        value = node.meta.get("val")
        spec: dict[int, object] = {}
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if not isinstance(size, torch.SymInt):
                    continue
                expr = size.node.expr
                if not expr.is_symbol:
                    raise ExportError(
                        f"input {node.name} dim {d} has derived size {expr}; only plain dynamic "
                        "dims are supported"
                    )
                if str(expr) not in hints:
                    hints[str(expr)] = dynamic_dim(*symbol_range(ep, expr))
                spec[d] = hints[str(expr)]
        shapes.append(spec)
    return shapes


def describe_inputs(
    ep: ExportedProgram, count: int, index_bounds: dict[int, int] | None = None
) -> tuple[list[InputSpec], dict[str, SymbolRange]]:
    """The first ``count`` user inputs as :class:`InputSpec` (static sizes as ints, dynamic ones
    as symbol names, ``index_bounds`` by input index) and the range of every symbol they use."""
    bounds = index_bounds or {}
    inputs, symbols = [], {}
    for i, node in enumerate(user_input_nodes(ep)[:count]):
        value = node.meta["val"]
        shape: list[int | str] = []
        for size in value.shape:
            if not isinstance(size, torch.SymInt):
                shape.append(int(size))
                continue
            expr = size.node.expr
            lo, hi = symbol_range(ep, expr)
            symbols[str(expr)] = SymbolRange(min=lo, max=hi)
            shape.append(str(expr))
        inputs.append(
            InputSpec(
                name=node.name, dtype=str(value.dtype).removeprefix("torch."), shape=shape,  # type: ignore[arg-type]
                index_bound=bounds.get(i),
            )
        )
    return inputs, symbols
