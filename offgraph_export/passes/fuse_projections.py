"""Fuse sibling projections: linears that read the same activation become one GEMM over their
concatenated weights, whose result is split back into the original outputs.

Why: at decode (one token) every projection is a matrix-vector product bound by reading its
weight, and a small one runs far below the memory bandwidth (a 512 x 2048 K or V projection reaches
a fraction of what a 3072 x 2048 one does). q/k/v read the same normed activation, and so do the
gate and up projections of a SwiGLU MLP: one GEMM each reads the same bytes in fewer, larger
launches. This holds for any model whose projections are ``aten.linear`` over parameters; nothing
here knows attention or MLP layouts.

A group is every ``aten.linear(x, W_i[, b_i])`` with the same ``x`` and no node between the first
and the last that may write memory (a write through a view of ``x`` leaves its node in place, so
linears on both sides of it read different values: the group is cut there), where the ``W_i`` are
distinct parameters or buffers of one dtype and device with the same number of input features, and
either all or none have a bias (each a distinct parameter of shape ``(out_features,)`` in the
weights' dtype and device; a broadcasting bias leaves the group unfused). The fused weight (and bias) is a new
parameter that does not require grad; the originals are removed when nothing else reads them.
The rewritten module is re-traced with ``torch.export`` and the program's own dynamic shapes, so the
graph signature is export's own.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx
from torch.export import ExportedProgram

from offgraph_export.passes.graph_utils import attr_tensor, no_write_between, retrace_rewritten
from offgraph_export.passes.result import PassResult

__all__ = ["fuse_projections", "fused_weight_name"]

_aten = torch.ops.aten


def _bias(node: fx.Node) -> object:
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _runs(linears: list[fx.Node]) -> list[list[fx.Node]]:
    """``linears`` (one activation's readers, in graph order) cut where a node between them may
    write memory: a write through a view of the activation does not rebind its node, so a linear
    after it reads other values than one before it, and one GEMM placed before the first would
    read the old ones for all."""
    runs = [[linears[0]]]
    for node in linears[1:]:
        if no_write_between(runs[-1][0], node):
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def _fusable(gm: fx.GraphModule, linears: list[fx.Node]) -> bool:
    """Distinct 2-D weights of one dtype, device and input width; biases all absent, or all
    distinct parameters of shape ``(out_features,)`` in the weights' dtype and device (what
    concatenation keeps exact)."""
    weights = [attr_tensor(gm, n.args[1]) for n in linears]
    if len(linears) < 2 or any(w is None or w.dim() != 2 for w in weights):
        return False
    first = weights[0]
    if not all(w.shape[1] == first.shape[1] and w.dtype == first.dtype and w.device == first.device for w in weights):
        return False
    targets = [n.args[1].target for n in linears]
    if len(set(targets)) != len(targets):
        return False
    bias_nodes = [_bias(n) for n in linears]
    if all(b is None for b in bias_nodes):
        return True
    biases = [attr_tensor(gm, b) for b in bias_nodes]
    if any(b is None for b in biases) or len({b.target for b in bias_nodes}) != len(bias_nodes):  # type: ignore[union-attr]
        return False
    return all(
        b.shape == (w.shape[0],) and b.dtype == w.dtype and b.device == w.device  # type: ignore[union-attr]
        for b, w in zip(biases, weights)
    )


def _groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Sibling linears by the activation they read, in graph order, with no write between them."""
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == _aten.linear.default and isinstance(node.args[0], fx.Node):
            by_input.setdefault(node.args[0], []).append(node)
    return [run for linears in by_input.values() for run in _runs(linears) if _fusable(gm, run)]


def fused_weight_name(index: int) -> str:
    """The name of the ``index``-th fused group's weight in the rewritten program."""
    return f"offgraph_fused_{index}_weight"


def fuse_projections(ep: ExportedProgram, example_inputs: Sequence[torch.Tensor]) -> PassResult[list[list[str]]]:
    """Produce the fused groups (each the weight names it fused, in order); ``modified`` when any
    group was fused."""
    gm = ep.module()
    groups = _groups(gm)
    if not groups:
        return PassResult(ep, modified=False, produced=[])
    fused_names: list[list[str]] = []
    replaced: set[str] = set()
    graph = gm.graph
    for index, linears in enumerate(groups):
        x = linears[0].args[0]
        weights = [attr_tensor(gm, n.args[1]) for n in linears]
        bias_nodes = [_bias(n) for n in linears]
        sizes = [int(w.shape[0]) for w in weights]  # type: ignore[union-attr]
        weight_name = fused_weight_name(index)
        gm.register_parameter(weight_name, torch.nn.Parameter(torch.cat(weights).detach(), requires_grad=False))  # type: ignore[arg-type]
        bias_name = None
        if bias_nodes[0] is not None:
            bias_name = f"offgraph_fused_{index}_bias"
            bias = torch.cat([attr_tensor(gm, b) for b in bias_nodes]).detach()  # type: ignore[misc]
            gm.register_parameter(bias_name, torch.nn.Parameter(bias, requires_grad=False))
        with graph.inserting_before(linears[0]):
            w = graph.get_attr(weight_name)
            args = (x, w, graph.get_attr(bias_name)) if bias_name else (x, w)
            out = graph.call_function(_aten.linear.default, args)
            parts = graph.call_function(_aten.split_with_sizes.default, (out, sizes, -1))
            for i, node in enumerate(linears):
                item = graph.call_function(operator.getitem, (parts, i))
                node.replace_all_uses_with(item)
        fused_names.append([str(n.args[1].target) for n in linears])
        replaced.update(fused_names[-1])
        replaced.update(str(b.target) for b in bias_nodes if isinstance(b, fx.Node))
        for node in linears:
            graph.erase_node(node)
    return PassResult(retrace_rewritten(gm, ep, example_inputs, replaced, "fused projections"), modified=True,
                      produced=fused_names)
