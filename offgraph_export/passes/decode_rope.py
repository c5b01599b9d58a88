"""Fold the rotary embedding of the decode method's queries and keys into its attention kernel.

Why: at one token the rotary embedding is one small pointwise kernel per layer (on the H200 about
2.5 us of a 1.2 ms Llama-1B step, 16 launches), reading and writing a few hundred bytes. The
one-token attention kernel already loads the query and the new key, so it can rotate them itself
(``kernels/attend_decode.py``, with ``attend_common._rotate_half``) given the step's ``cos``/``sin``
rows, which the program computes once per step for every layer.

The pattern is the eager form of Llama-family models, on the query and on the key of one
``offgraph_lowered::triton_update_and_attend`` call of width 1 (or of the batched artifact's
``offgraph_lowered::triton_paged_update_and_attend``, whose one-token kernel rotates them the
same way)::

    r = x * cos + cat([-x[..., D/2:], x[..., :D/2]], -1) * sin

with ``cos``/``sin`` one row of ``D`` values in ``x``'s dtype, the same two nodes for the query and
the key, and every value inside the pattern used only there. The call then takes ``x`` for q and
k and the rows as ``rope_cos``/``rope_sin``; the kernel computes the same products and sum in
fp32 and rounds once, as Inductor's fused rotary kernel does (eager rounds each product and the sum:
in bf16 the two may differ by one unit in the last place). A call whose pattern has a memory write between its first node and the call
is left alone, and so is one given rotary rows already. The call's arguments are read and set by
the op's schema names (:func:`~offgraph_export.passes.graph_utils.op_arguments`), however the call
passes them. Run it on the decode method before ``functionalize``. Produces how many attention
calls took their rotary embedding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.export import ExportedProgram

from offgraph_export.passes.graph_utils import (
    binary_operands, drop_dead, is_call, no_write_between, only_user, op_arguments, replace_op_arguments,
    tensor_value, users,
)
from offgraph_export.passes.result import PassResult

__all__ = ["decode_rope", "fold_rope", "is_rotary_row"]

aten = torch.ops.aten
_END = 2**63 - 1


def _is_half(node: object, x: torch.fx.Node, lo: int, hi: int) -> bool:
    """``node`` is ``x[..., lo:hi]`` on the last dim (``hi`` may be any bound past the end)."""
    if not is_call(node, aten.slice.Tensor) or node.args[0] is not x or node.kwargs or only_user(node) is None:
        return False
    rank, d = tensor_value(x).dim(), tensor_value(x).shape[-1]
    dim, start = node.args[1], node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else _END
    step = node.args[4] if len(node.args) > 4 else 1
    return dim in (-1, rank - 1) and start == lo and step == 1 and (end == hi or (hi == d and end >= d))


def is_rotary_row(node: object, x: torch.Tensor, per_token: bool = False) -> bool:
    """``node`` is one rotary row: ``D`` values in ``x``'s dtype, every other dim of size 1; with
    ``per_token``, one row per token of ``x`` (``[..., T, D]``, ``T`` x's token dim, every other
    dim 1)."""
    value = tensor_value(node)
    if value is None or value.dtype != x.dtype or value.dim() < 1 or value.shape[-1] != x.shape[-1]:
        return False
    if not per_token:
        return value.numel() == x.shape[-1]
    if value.dim() < 2 or x.dim() < 2:
        return False
    return _same_size(value.shape[-2], x.shape[-2]) and all(isinstance(n, int) and n == 1 for n in value.shape[:-2])


def _same_size(a: object, b: object) -> bool:
    """Two sizes that are the same int or the same symbol (no guard is added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and str(a.node.expr) == str(b.node.expr)


def _match_rope(
    r: object, per_token: bool = False,
) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]]:
    """``(x, cos, sin, pattern nodes)`` when ``r`` is ``x * cos + rotate_half(x) * sin`` (rows
    one per token where ``per_token``)."""
    operands = binary_operands(r, aten.add.Tensor)
    if operands is None:
        return None
    for a, b in (operands, operands[::-1]):
        direct, rotated = binary_operands(a, aten.mul.Tensor), binary_operands(b, aten.mul.Tensor)
        if direct is None or rotated is None or only_user(a) is not r or only_user(b) is not r:
            continue
        for cat, sin in (rotated, rotated[::-1]):
            if not is_call(cat, aten.cat.default) or only_user(cat) is not b:
                continue
            pieces, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
            if len(pieces) != 2 or not is_call(pieces[0], aten.neg.default) or only_user(pieces[0]) is not cat:
                continue
            hi_half, lo_half = pieces[0].args[0], pieces[1]
            for x, cos in (direct, direct[::-1]):
                xv = tensor_value(x)
                if xv is None or xv.shape[-1] % 2 or dim not in (-1, xv.dim() - 1):
                    continue
                half, d = xv.shape[-1] // 2, xv.shape[-1]
                if not (_is_half(hi_half, x, half, d) and _is_half(lo_half, x, 0, half)):
                    continue
                if set(users(x)) != {a, hi_half, lo_half} or not (is_rotary_row(cos, xv, per_token) and is_rotary_row(sin, xv, per_token)):
                    continue
                if any(tensor_value(n).dtype != xv.dtype for n in (a, b, r)):
                    continue
                return x, cos, sin, [a, hi_half, lo_half, pieces[0], cat, b, r]
    return None


def fold_rope(node: torch.fx.Node, order: dict[torch.fx.Node, int], per_token: bool = False) -> bool:
    """Give the attention call ``node`` its query's and key's rotary embedding to apply, where
    both match the pattern with the same rows and nothing writes memory between the pattern's
    first node and the call: the call then takes ``x`` for q and k and the rows as
    ``rope_cos``/``rope_sin``. ``per_token``: rows one per token (a paged call of one row per
    session, ``passes/decode_sessions.py``); else a one-token call and one row. Whether it
    folded; the pattern's nodes are left for :func:`drop_dead`."""
    args = op_arguments(node)
    if args.get("rope_cos") is not None or args.get("rope_sin") is not None:
        return False  # it takes rotary rows already
    q_val = tensor_value(args["q"])
    if q_val is None:
        return False
    if not per_token and (not isinstance(q_val.shape[2], int) or q_val.shape[2] != 1):
        return False
    q, k = _match_rope(args["q"], per_token), _match_rope(args["k"], per_token)
    if q is None or k is None or q[1] is not k[1] or q[2] is not k[2]:
        return False
    first = min(q[3] + k[3], key=order.__getitem__)
    if not no_write_between(first, node):
        return False
    replace_op_arguments(node, q=q[0], k=k[0], rope_cos=q[1], rope_sin=q[2])
    return True


def decode_rope(ep: ExportedProgram) -> PassResult[int]:
    """Fold the rotary embedding into each one-token attention call of ``ep`` (in place); see the
    module docstring."""
    import offgraph_export.kernels.paged_attend  # noqa: F401  (defines the paged op)
    import offgraph_export.kernels.triton_attend  # noqa: F401  (defines the op)

    ops = torch.ops.offgraph_lowered
    attends = (ops.triton_update_and_attend.default, ops.triton_paged_update_and_attend.default)
    graph = ep.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    folded = 0
    for node in list(graph.nodes):
        if any(is_call(node, attend) for attend in attends) and fold_rope(node, order):
            folded += 1
    if folded:
        drop_dead(graph)
        graph.lint()
        ep.graph_module.recompile()
    return PassResult(ep, modified=bool(folded), produced=folded)
