"""Graph helpers used by several passes and by the pipeline: the user-input placeholders, the
symbols of their dynamic dims and those symbols' ranges; small node predicates for the passes
that match patterns (users, single users, writes between two nodes), their dead-code
elimination, and replacing a node without leaving the graph signature behind; an op call's
arguments read and replaced by its schema's names (a call may pass any of them by position or by
keyword, so no pass counts positions); an op's calls replaced by the aten nodes of its form
without re-tracing the program."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import TensorArgument

from offgraph_export.compat import dynamic_dim, program_copy
from offgraph_export.errors import ExportError
from offgraph_export.specs.artifact import InputSpec, SymbolRange

__all__ = [
    "ASSERT_METADATA",
    "attr_tensor",
    "weight_linears",
    "last_linear_weight",
    "reaches_output",
    "read_elsewhere",
    "drop_unused_attrs",
    "inline_calls",
    "dequantized_weight_args",
    "weight_names",
    "weight_target",
    "weight_tensor",
    "rows_linear_site",
    "leading_sizes",
    "linear_to_rows_kernel",
    "add_buffer",
    "retrace_rewritten",
    "binary_operands",
    "drop_dead",
    "is_call",
    "no_write_between",
    "op_arguments",
    "only_user",
    "replace_node",
    "replace_op_arguments",
    "tensor_value",
    "users",
    "user_input_nodes",
    "size_expr",
    "symbol_range",
    "input_dynamic_shapes",
    "describe_inputs",
    "output_width_dims",
]


def user_input_nodes(ep: ExportedProgram) -> list[torch.fx.Node]:
    """Placeholders of the user inputs, in the order the runtime passes them."""
    by_name = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [by_name[name] for name in ep.graph_signature.user_inputs]


def user_output_values(ep: ExportedProgram) -> list[object]:
    """The (fake) values of the user outputs, in the order the compiled program returns them."""
    from torch.export.graph_signature import OutputKind

    (returned,) = [n for n in ep.graph.nodes if n.op == "output"]
    values = returned.args[0]
    return [
        node.meta.get("val") if isinstance(node, torch.fx.Node) else node
        for node, spec in zip(values, ep.graph_signature.output_specs)
        if spec.kind == OutputKind.USER_OUTPUT
    ]


def output_width_dims(ep: ExportedProgram, width_symbol: str) -> Optional[list[int]]:
    """For each user output, the one dim whose size is the step width ``width_symbol``: the
    outputs are then per token along it. None where some output is not (no such dim, two of them,
    another dynamic size, or not a tensor), which rules out padding a step with repeated tokens."""
    dims: list[int] = []
    for value in user_output_values(ep):
        if not isinstance(value, torch.Tensor):
            return None
        hits = [d for d, size in enumerate(value.shape) if str(size_expr(size)) == width_symbol]
        others = [size for size in value.shape if isinstance(size, torch.SymInt) and str(size_expr(size)) != width_symbol]
        if len(hits) != 1 or others:
            return None
        dims.append(hits[0])
    return dims


def size_expr(size: object) -> object:
    """The sympy expression of a symbolic size, or the int itself."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def symbol_range(ep: ExportedProgram, expr: object) -> tuple[int, int | None]:
    """``(min, max)`` of a dynamic dim's symbol (``max`` None when unbounded)."""
    rng = ep.range_constraints.get(expr)  # type: ignore[call-overload]
    if rng is None:
        raise ExportError(f"the program has no range for the size {expr}")
    return int(rng.lower), (int(rng.upper) if rng.upper.is_finite else None)


def input_dynamic_shapes(ep: ExportedProgram, hints: dict[str, object] | None = None) -> list[dict[int, object]]:
    """``dynamic_shapes`` for the user inputs, rebuilt from the program's own symbols: one hint per
    symbol, so dims that shared a symbol share a hint again. ``hints``: filled with the hint of
    each symbol, by name (for new inputs that share one)."""
    hints = {} if hints is None else hints
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


# -- node predicates for pattern-matching passes ---------------------------------------------------

#: export's dtype/device assert: it reads a value but computes nothing
ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def attr_tensor(gm: torch.nn.Module, node: object) -> Optional[torch.Tensor]:
    """The tensor a ``get_attr`` node of an unlifted module (``ep.module()``) reads, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) else None


def drop_unused_attrs(gm: torch.fx.GraphModule, targets: set[str]) -> None:
    """Delete the attributes named in ``targets`` that no ``get_attr`` node reads any more (a
    rewrite replaced their readers), so a re-trace does not carry them as dead weights."""
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - used:
        owner_path, _, name = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        delattr(owner, name)


def retrace_rewritten(
    gm: torch.fx.GraphModule, ep: ExportedProgram, example_inputs, replaced: set[str], what: str,
) -> ExportedProgram:
    """``ep.module()`` after a rewrite of its graph, as a program again: dead code and the
    attributes in ``replaced`` that nothing reads any more dropped, then re-traced with
    ``torch.export`` and ``ep``'s own dynamic shapes, so the graph signature is export's own.
    ``what`` names the rewrite in the error a failed trace raises."""
    gm.graph.eliminate_dead_code()
    drop_unused_attrs(gm, replaced)
    gm.recompile()
    try:
        return torch.export.export(gm, tuple(example_inputs), dynamic_shapes=tuple(input_dynamic_shapes(ep)), strict=False)
    except Exception as exc:  # export raises many types; keep the cause chained
        raise ExportError(f"re-tracing the program with {what} failed: {exc}") from exc


def tensor_value(node: object) -> Optional[torch.Tensor]:
    """The (fake) tensor a node produces, or None."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Users that compute something (export's dtype asserts do not)."""
    return [u for u in node.users if u.target is not ASSERT_METADATA]


def only_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    found = users(node)
    return found[0] if len(found) == 1 else None


def is_call(node: object, target: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def binary_operands(node: object, target: object) -> Optional[tuple[object, object]]:
    """``(a, b)`` when ``node`` is a plain two-operand call of ``target`` (no alpha or other
    keyword), else None."""
    if not is_call(node, target) or len(node.args) != 2 or node.kwargs:
        return None
    return node.args[0], node.args[1]


def _schema_names(node: torch.fx.Node) -> list[str]:
    """The argument names of the op ``node`` calls, in the schema's order."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        raise ExportError(f"node {node.name} ({target}) is not a call of an op with a schema")
    return [a.name for a in target._schema.arguments]


def op_arguments(node: torch.fx.Node) -> dict[str, object]:
    """The arguments of ``node``, a call of an op (``OpOverload``), by the schema's names: those
    passed by position matched to the schema in order, those passed by keyword as given. An
    argument left at its default is absent."""
    values: dict[str, object] = dict(zip(_schema_names(node), node.args))
    values.update(node.kwargs)
    return values


def replace_op_arguments(node: torch.fx.Node, **values: object) -> None:
    """Give the op call ``node`` these arguments, by the schema's names: each where the call
    passes it (by position or by keyword), one it leaves at its default by keyword."""
    names = _schema_names(node)
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in values.items():
        if name not in names:
            raise ExportError(
                f"node {node.name} ({node.target}) has no argument {name!r}; its schema names {names}"
            )
        index = names.index(name)
        if index < len(args):
            args[index] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _writes(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write memory (an in-place or out= op, a mutating kernel call)."""
    return node.op == "call_function" and node.target is not ASSERT_METADATA and node.is_impure()


def no_write_between(first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """True when no node from ``first`` up to (not including) ``last`` writes memory: a rewrite
    that computes at ``last`` what a pattern read from ``first`` on reads the same values."""
    node = first
    while node is not last:
        if _writes(node):
            return False
        node = node.next
    return True


def drop_dead(graph: torch.fx.Graph) -> None:
    """Dead-code elimination that also drops export's dtype asserts on values nothing else uses
    (they would keep a folded pattern's nodes alive)."""
    while True:
        graph.eliminate_dead_code()
        asserts = [
            n for n in graph.nodes
            if n.target is ASSERT_METADATA and isinstance(n.args[0], torch.fx.Node)
            and n.args[0].op != "placeholder" and not users(n.args[0])
        ]
        if not asserts:
            return
        for n in asserts:
            graph.erase_node(n)


def replace_node(ep: ExportedProgram, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """``old.replace_all_uses_with(new)``, and where ``old`` was one of the program's outputs, the
    graph signature's output spec now names ``new`` (``replace_all_uses_with`` rewires the output
    node only; a signature naming a node that is gone fails ``ExportedProgram.validate``)."""
    old.replace_all_uses_with(new)
    for spec in ep.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name == old.name:
            spec.arg = TensorArgument(name=new.name)


def weight_linears(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """The linears whose weight argument is a 2-D floating attribute, by the attribute's name, in
    graph order."""
    found: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.linear.default or len(node.args) < 2:
            continue
        weight = attr_tensor(gm, node.args[1])
        if weight is not None and weight.dim() == 2 and weight.is_floating_point():
            found.setdefault(str(node.args[1].target), []).append(node)
    return found


def last_linear_weight(gm: torch.fx.GraphModule, linears: dict[str, list[torch.fx.Node]]) -> tuple[str, bool] | None:
    """The weight (a key of ``linears``, :func:`weight_linears`) of the last of those linears in
    graph order, a decoder's output projection (the lm_head), and whether that linear's result is
    the program's output (:func:`reaches_output`: False where the model computes its output
    projection otherwise and the last linear is some layer's). None without one."""
    for node in reversed(gm.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default and len(node.args) >= 2:
            target = getattr(node.args[1], "target", None)
            if str(target) in linears and node in linears[str(target)]:
                return str(target), reaches_output(node)
    return None


def reaches_output(node: torch.fx.Node, depth: int = 16) -> bool:
    """Whether ``node``'s value is a graph output, directly or through nodes that read no other
    tensor (views, casts, slices, a soft-cap's scalar multiplies and tanh), at most ``depth`` deep."""
    for user in node.users:
        if user.op == "output":
            return True
        others = [a for a in user.all_input_nodes if a is not node]
        if depth > 0 and user.op == "call_function" and not others and reaches_output(user, depth - 1):
            return True
    return False


def read_elsewhere(gm: torch.fx.GraphModule, target: str, linears: list[torch.fx.Node]) -> bool:
    """Whether any node other than these linears (as their weight) reads attribute ``target``."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) == target:
            for user in node.users:
                if user not in linears or user.args[1] is not node or node in (*user.args[:1], *user.args[2:]):
                    return True
    return False


def _traced_form(node: torch.fx.Node, form: Callable[..., torch.Tensor]) -> Optional[torch.fx.GraphModule]:
    """``form`` applied to ``node``'s arguments, traced alone into aten nodes over the call's
    tensor arguments (their fake values, in the program's own fake mode), the other arguments
    baked in; None where that trace would not splice cleanly (a tensor argument without a value,
    a constant tensor of its own)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    tensor_args = [i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node)]
    values = [tensor_value(node.args[i]) for i in tensor_args]
    if node.kwargs or any(v is None for v in values):
        return None

    def apply(*tensors: torch.Tensor) -> torch.Tensor:
        args = list(node.args)
        for i, t in zip(tensor_args, tensors, strict=True):
            args[i] = t
        return form(*args)

    fake_mode = detect_fake_mode(values)
    if fake_mode is None:
        return None
    with fake_mode:
        traced = make_fx(apply, tracing_mode="real")(*values)
    if any(n.op in ("get_attr", "call_module") for n in traced.graph.nodes):
        return None
    return traced


def inline_calls(ep: ExportedProgram, forms: Mapping[Any, Callable[..., torch.Tensor]]) -> tuple[ExportedProgram, int]:
    """A copy of ``ep`` (sharing its weights) in which every call of an op of ``forms`` (op
    overload -> its aten form) is replaced by the aten nodes of its form, traced alone on the
    call's own argument values and spliced where the call was: what ``run_decompositions`` with
    ``forms`` does, without re-tracing the whole program (a quantized 1B program's 65 dequantized
    weights: 12.6 s on the dev CPU). One trace per distinct call (its argument shapes and
    constants). Returns the program and the calls replaced; ``ep`` itself is unchanged, and
    where no call of ``forms`` splices cleanly it is returned as it is."""
    sites = [n for n in ep.graph.nodes if n.op == "call_function" and n.target in forms]
    if not sites:
        return ep, 0
    out = program_copy(ep)
    graph = out.graph
    traces: dict[tuple, Optional[torch.fx.GraphModule]] = {}
    replaced = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in forms]:
        key = (node.target, *(
            (str(tuple(a.meta["val"].shape)), a.meta["val"].dtype) if isinstance(a, torch.fx.Node) and tensor_value(a) is not None
            else ("node", a.name) if isinstance(a, torch.fx.Node) else ("const", repr(a))
            for a in node.args))
        if key not in traces:
            traces[key] = _traced_form(node, forms[node.target])
        traced = traces[key]
        if traced is None:
            continue
        arguments = iter(a for a in node.args if isinstance(a, torch.fx.Node))
        env: dict[torch.fx.Node, Any] = {}
        result = None
        with graph.inserting_before(node):
            for small in traced.graph.nodes:
                if small.op == "placeholder":
                    env[small] = next(arguments)
                elif small.op == "output":
                    result = env[small.args[0]]
                else:
                    copied = graph.node_copy(small, lambda a: env[a])
                    copied.meta = {**{k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")},
                                   "val": small.meta["val"]}
                    env[small] = copied
        assert isinstance(result, torch.fx.Node)
        replace_node(out, node, result)
        graph.erase_node(node)
        replaced += 1
    if not replaced:
        return ep, 0
    graph.lint()
    out.graph_module.recompile()
    return out, replaced


def dequantized_weight_args(
    w: object, weights: set[str],
) -> Optional[tuple[torch.fx.Node, torch.fx.Node, Optional[torch.fx.Node], int]]:
    """``(qweight, scales, zeros, group_size)`` when ``w`` is ``offgraph::dequantize_weight`` of
    weight placeholders (``weights``: :func:`weight_names`; a row-major 2-D ``qweight``)."""
    from offgraph_export.ops.quantized import dequantize_weight  # noqa: F401  (defines the op)

    if not is_call(w, torch.ops.offgraph.dequantize_weight.default):
        return None
    q, scales, zeros, group = w.args[:4]
    stored = [a for a in (q, scales, zeros) if a is not None]
    if not all(isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in weights for a in stored):
        return None
    qv = tensor_value(q)
    if qv is None or qv.dim() != 2 or qv.stride(1) != 1 or not isinstance(group, int):
        return None
    return q, scales, zeros, group


def weight_names(ep: ExportedProgram) -> set[str]:
    """The placeholders that carry the program's parameters, buffers and lifted constants."""
    sig = ep.graph_signature
    return {*sig.inputs_to_parameters, *sig.inputs_to_buffers, *sig.inputs_to_lifted_tensor_constants}


def weight_target(ep: ExportedProgram, node: torch.fx.Node) -> Optional[str]:
    """The name (state dict or constants key) of the weight placeholder ``node`` of ``ep``, or None."""
    sig = ep.graph_signature
    return (sig.inputs_to_parameters.get(node.name) or sig.inputs_to_buffers.get(node.name)
            or sig.inputs_to_lifted_tensor_constants.get(node.name))


def weight_tensor(ep: ExportedProgram, node: torch.fx.Node) -> Optional[torch.Tensor]:
    """The real tensor a weight placeholder of ``ep`` carries (parameter, buffer or lifted
    constant), or None."""
    target = weight_target(ep, node)
    if target is None:
        return None
    value = ep.state_dict.get(target)
    return value if value is not None else ep.constants.get(target)


def add_buffer(ep: ExportedProgram, target: str, value: torch.Tensor) -> torch.fx.Node:
    """A new persistent buffer ``target`` of ``ep`` holding ``value`` (AOTInductor stores a buffer
    under its name, as the program's other weights): a placeholder after the last weight
    placeholder (the signature lists weights before user inputs), its input spec at the same
    position, ``value`` in ``ep.state_dict`` (give ``ep`` a state dict of its own first when it
    shares one) and a fake value of the program's fake mode as its ``val``."""
    from torch._guards import detect_fake_mode
    from torch.export.graph_signature import InputKind
    from torch.export.graph_signature import InputSpec as SigInputSpec

    if target in ep.constants or target in ep.state_dict:
        raise ExportError(f"the program already holds a weight named {target!r}")
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    weights = weight_names(ep)
    index = max((i + 1 for i, n in enumerate(placeholders) if n.name in weights), default=0)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders if n.meta.get("val") is not None])
    if index < len(placeholders):
        with ep.graph.inserting_before(placeholders[index]):
            node = ep.graph.placeholder("b_" + target.replace(".", "_"))
    else:
        with ep.graph.inserting_after(placeholders[-1]) if placeholders else ep.graph.inserting_before(None):
            node = ep.graph.placeholder("b_" + target.replace(".", "_"))
    node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True) if fake_mode is not None else value
    ep.graph_signature.input_specs.insert(
        index, SigInputSpec(kind=InputKind.BUFFER, arg=TensorArgument(name=node.name), target=target, persistent=True)
    )
    ep.state_dict[target] = value
    return node


def leading_sizes(x: torch.Tensor) -> Optional[list[int]]:
    """``x``'s sizes but the last, the one symbolic size (if any) as -1; None for two or more."""
    sizes = [int(d) if isinstance(d, int) else -1 for d in x.shape[:-1]]
    return sizes if sizes.count(-1) <= 1 else None


def rows_linear_site(node: torch.fx.Node, match_weight: Callable[[object], Any]) -> Optional[tuple[Any, ...]]:
    """``(x, *match_weight(w), bias, leading sizes)`` when ``node`` is ``aten.linear(x, w[, bias])``
    whose weight ``match_weight`` accepts (a tuple, or None) and whose ``x`` has the weight's dtype
    (``w``'s ``dequantize_weight`` dtype argument), two or more dims and at most one symbolic
    leading size (:func:`leading_sizes`): a linear the cpu quantized-kernel passes may rewrite with
    :func:`linear_to_rows_kernel`."""
    if not is_call(node, torch.ops.aten.linear.default):
        return None
    x, w, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    found = match_weight(w)
    xv = tensor_value(x)
    if found is None or xv is None or tensor_value(node) is None or xv.dtype != w.args[4] or xv.dim() < 2:
        return None
    lead = leading_sizes(xv)
    return None if lead is None else (x, *found, bias, lead)


def linear_to_rows_kernel(
    ep: ExportedProgram, node: torch.fx.Node, x: torch.fx.Node, bias: object, lead: list[int], k: int, n: int,
    kernel: Any, args: tuple[Any, ...],
) -> None:
    """Replace the linear ``node`` of ``ep`` by ``view(x, [-1, k])`` -> ``kernel(rows, *args)`` ->
    ``view`` to ``lead`` (:func:`leading_sizes`) and ``n`` [-> ``add`` of ``bias``], each new node
    with its fake value and the linear's source metadata (the cpu quantized-kernel passes)."""
    graph = ep.graph
    xv, out = tensor_value(x), tensor_value(node)
    with graph.inserting_before(node):
        rows = graph.call_function(torch.ops.aten.view.default, (x, [-1, int(k)]))
        rows.meta["val"] = xv.view(-1, int(k))
        mm = graph.call_function(kernel, (rows, *args))
        mm.meta["val"] = kernel(rows.meta["val"], *(tensor_value(a) if isinstance(a, torch.fx.Node) else a for a in args))
        result = graph.call_function(torch.ops.aten.view.default, (mm, [*lead, int(n)]))
        result.meta["val"] = mm.meta["val"].view(*lead, int(n))
        created = [rows, mm, result]
        if bias is not None:
            result = graph.call_function(torch.ops.aten.add.Tensor, (result, bias))
            result.meta["val"] = out
            created.append(result)
    for created_node in created:
        created_node.meta.update({key: node.meta[key] for key in ("stack_trace", "nn_module_stack") if key in node.meta})
    replace_node(ep, node, result)
    graph.erase_node(node)
