"""Find the neutral KV op nodes of a graph and read their arguments.

Shared by every pass: one place that knows the op's schema
``(q, k, v, position, layer_id, scale, out_dtype[, softcap][, sinks])`` and the targets that carry
it. The two trailing arguments are optional (absent from ExecuTorch's ``kvcache::`` op, left out
of a call that keeps their default): a site without them reads None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from offgraph_export.errors import ExportError
from offgraph_export.ops import NEUTRAL_OP_NAMES
from offgraph_export.passes.graph_utils import op_arguments

__all__ = ["KvSite", "find_kv_sites", "is_neutral_op", "same_size"]

_ARG_NAMES = ("q", "k", "v", "position", "layer_id", "scale", "out_dtype")
#: optional trailing arguments, None where a node leaves them out
_OPTIONAL_NAMES = ("softcap", "sinks")


def same_size(a: object, b: object) -> bool:
    """Whether two traced sizes (ints or SymInts) are the same size."""
    return a == b if isinstance(a, int) and isinstance(b, int) else str(a) == str(b)


def is_neutral_op(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name in NEUTRAL_OP_NAMES
    return False


@dataclass(frozen=True)
class KvSite:
    """One neutral-op node with its arguments resolved by name."""

    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    position: fx.Node
    layer_id: object
    scale: object
    out_dtype: object
    #: a constant float (soft-capping) or None
    softcap: object = None
    #: the node of the ``[Hq]`` sink logits (a parameter of the program) or None
    sinks: fx.Node | None = None

    def val(self, name: str) -> torch.Tensor:
        arg = getattr(self, name)
        value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"node {self.node.name}: argument {name} has no traced tensor value")
        return value


def find_kv_sites(graph: fx.Graph) -> list[KvSite]:
    sites = []
    for node in graph.nodes:
        if not is_neutral_op(node):
            continue
        values = op_arguments(node)
        missing = [n for n in _ARG_NAMES if n not in values]
        if missing:
            raise ExportError(
                f"node {node.name} ({node.target}) lacks arguments {missing}; expected the schema "
                f"update_and_attend{_ARG_NAMES}"
            )
        optional = {n: values.get(n) for n in _OPTIONAL_NAMES}
        sites.append(KvSite(node=node, **{n: values[n] for n in _ARG_NAMES}, **optional))
    return sites
