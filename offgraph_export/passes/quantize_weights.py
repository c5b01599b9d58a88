"""Store every linear's weight quantized (int8 per output channel, or int4 per group of input
features) and compute the linear from the dequantized weight (design section 11).

Why: a decode step reads every weight once per token, so its floor is the weights' bytes; int8
halves them and int4 quarters them. Quantized here, on the program rather than on the user's
modules, every ``aten.linear(x, W[, b])`` of any model is found the same way, including the ones
:mod:`~offgraph_export.passes.fuse_projections` made (quantization is per row, so quantizing a
fused weight is quantizing each of its parts: the oracle can quantize the model's own parameters).

A linear whose weight is a 2-D floating parameter or buffer of the program (a ``get_attr`` of the
unlifted module) gets the weight ``offgraph::dequantize_weight`` computes from the stored
constants, in the weight's dtype (:mod:`~offgraph_export.ops.quantized`: one node, which the
decode GEMV can take into its kernel and ``functionalize`` decomposes otherwise): a submodule
holding ``qweight``, ``scales`` (and ``zeros``) whose forward is that call. The float
weight is dropped unless another node reads it (a tied embedding table: ``shared``). The rewritten
module is re-traced with ``torch.export`` and the program's own dynamic shapes, so the graph
signature is export's own. Produces the :class:`~offgraph_export.specs.quantization.QuantizationSpec`
the specs record (None when the program has no such linear).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.passes.graph_utils import attr_tensor, retrace_rewritten
from offgraph_export.passes.result import PassResult
from offgraph_export.ops.quantized import dequantize_weight
from offgraph_export.reference.weight_quant import QuantizedTensors, quantize
from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight

__all__ = ["quantize_weights", "QuantizedLinearWeight"]

_aten = torch.ops.aten


class QuantizedLinearWeight(torch.nn.Module):
    """Holds one weight's stored form; its forward is the dequantized weight ``W'`` in ``dtype``."""

    def __init__(self, stored: QuantizedTensors, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size = stored.group_size
        self.dtype = dtype
        self.register_buffer("qweight", stored.qweight)
        self.register_buffer("scales", stored.scales)
        self.register_buffer("zeros", stored.zeros)

    def forward(self) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.scales, self.zeros, self.group_size or 0, self.dtype)


def _weight_linears(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """The linears whose weight argument is a 2-D floating attribute, by the attribute's name, in
    graph order."""
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != _aten.linear.default or len(node.args) < 2:
            continue
        weight = attr_tensor(gm, node.args[1])
        if weight is not None and weight.dim() == 2 and weight.is_floating_point():
            found.setdefault(str(node.args[1].target), []).append(node)
    return found


def _read_elsewhere(gm: fx.GraphModule, target: str, linears: list[fx.Node]) -> bool:
    """Whether any node other than these linears (as their weight) reads attribute ``target``."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) == target:
            for user in node.users:
                if user not in linears or user.args[1] is not node or node in (*user.args[:1], *user.args[2:]):
                    return True
    return False


def quantize_weights(
    ep: ExportedProgram,
    example_inputs: Sequence[torch.Tensor],
    scheme: str,
    group_size: int | None = None,
    sources: Mapping[str, list[str]] | None = None,
) -> PassResult[QuantizationSpec | None]:
    """Quantize every linear's weight as ``scheme`` (``group_size`` for int4). ``sources``: the
    model parameters each program weight was made of where that is not the weight itself (the
    fused ones, from :func:`~offgraph_export.passes.fuse_projections.fuse_projections`)."""
    gm = ep.module()
    groups = _weight_linears(gm)
    if not groups:
        return PassResult(ep, modified=False, produced=None)
    graph = gm.graph
    records: list[QuantizedWeight] = []
    replaced: set[str] = set()
    for index, (target, linears) in enumerate(groups.items()):
        weight = attr_tensor(gm, linears[0].args[1])
        assert weight is not None
        try:
            stored = quantize(weight, scheme, group_size, name=target)
        except OffgraphError as exc:
            raise ExportError(f"--quantize {scheme}: {exc}") from None
        shared = _read_elsewhere(gm, target, linears)
        module_name = f"offgraph_quant_{index}"
        gm.add_submodule(module_name, QuantizedLinearWeight(stored, weight.dtype))
        with graph.inserting_before(linears[0]):
            dequantized = graph.call_module(module_name, ())
        for node in linears:
            node.replace_input_with(node.args[1], dequantized)
        records.append(QuantizedWeight(
            name=target, sources=list((sources or {}).get(target, [target])), shape=list(weight.shape), shared=shared,
        ))
        replaced.add(target)
    spec = QuantizationSpec(scheme=scheme, group_size=group_size if scheme == "int4" else None, weights=records)  # type: ignore[arg-type]
    return PassResult(retrace_rewritten(gm, ep, example_inputs, replaced, "quantized weights"), modified=True, produced=spec)
