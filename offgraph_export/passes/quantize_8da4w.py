"""Every linear as torchao's 8da4w (int8 dynamic per-token activations, int4 weights per group of
input features) for a ``.pte`` delegated to XNNPACK (design section 11, "8da4w for .pte").

The same linears as :mod:`~offgraph_export.passes.quantize_weights` (the weight a 2-D floating
attribute of the program, after sibling projections are fused): each ``aten.linear(x, W[, b])``
becomes a call of a :class:`~offgraph_export.reference.quant_8da4w.DynamicQuantLinear` holding
torchao's quantized ``W`` (:func:`~offgraph_export.reference.quant_8da4w.quantized_weight`, the
rule ``check``'s oracle uses too), with ``x`` and ``b``. The float weight is dropped unless another
node reads it (a tied embedding table: ``shared``). Re-traced with ``torch.export``, each call
becomes torchao's ``choose_qparams_affine -> quantize_affine -> dequantize_affine`` on ``x`` and
``dequantize_affine`` on the int4 weight around the ``aten.linear``, the pattern ExecuTorch's
XNNPACK partitioner lowers to a dynamically quantized fully-connected layer; the weight's int8
data, scales and zero points are constants of the program. Produces the
:class:`~offgraph_export.specs.quantization.QuantizationSpec` the specs record (None when the
program has no such linear).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.passes.graph_utils import attr_tensor, op_arguments, read_elsewhere, retrace_rewritten, weight_linears
from offgraph_export.passes.result import PassResult
from offgraph_export.reference.quant_8da4w import SCHEME, DynamicQuantLinear, quantized_weight
from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight

__all__ = ["quantize_8da4w"]

def quantize_8da4w(
    ep: ExportedProgram,
    example_inputs: Sequence[torch.Tensor],
    group_size: int,
    sources: Mapping[str, list[str]] | None = None,
) -> PassResult[QuantizationSpec | None]:
    """Every linear of ``ep`` as 8da4w in groups of ``group_size``. ``sources``: the model
    parameters each program weight was made of where that is not the weight itself (the fused
    ones)."""
    gm = ep.module()
    groups = weight_linears(gm)
    if not groups:
        return PassResult(ep, modified=False, produced=None)
    graph = gm.graph
    records: list[QuantizedWeight] = []
    replaced: set[str] = set()
    for index, (target, linears) in enumerate(groups.items()):
        weight = attr_tensor(gm, linears[0].args[1])
        assert weight is not None
        try:
            quantized = quantized_weight(weight, group_size, name=target)
        except OffgraphError as exc:
            raise ExportError(f"--quantize {SCHEME}: {exc}") from None
        shared = read_elsewhere(gm, target, linears)
        module_name = f"offgraph_8da4w_{index}"
        gm.add_submodule(module_name, DynamicQuantLinear(quantized))
        for node in linears:
            args = op_arguments(node)
            bias = args.get("bias")
            with graph.inserting_before(node):
                call = graph.call_module(module_name, (args["input"],) if bias is None else (args["input"], bias))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
        records.append(QuantizedWeight(
            name=target, sources=list((sources or {}).get(target, [target])), shape=list(weight.shape), shared=shared,
        ))
        replaced.add(target)
    spec = QuantizationSpec(scheme=SCHEME, group_size=group_size, weights=records)
    return PassResult(retrace_rewritten(gm, ep, example_inputs, replaced, "8da4w-quantized linears"), modified=True, produced=spec)
