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

``stored``: weights that arrive quantized already (a model quantized with torchao,
:mod:`~offgraph_export.frontends.torchao_weights`), by model parameter name, whose float values in the
program are their ``W'``: they are stored as given, never quantized again (a fused weight's parts
joined row-wise), and ``others=False`` leaves every other linear float.

``lm_head``: the scheme of the program's last linear's weight where it is not ``scheme``
(``--quantize-lm-head``; ``none`` leaves it float): the output projection, whose error reaches the
logits unnormalized (:func:`~offgraph_export.passes.graph_utils.last_linear_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError, OffgraphError
from offgraph_export.passes.graph_utils import attr_tensor, last_linear_weight, read_elsewhere, retrace_rewritten, weight_linears
from offgraph_export.passes.result import PassResult
from offgraph_export.ops.quantized import dequantize_weight
from offgraph_export.reference.weight_quant import QuantizedTensors, dequantize, quantize
from offgraph_export.specs.quantization import GROUPED_SCHEMES, QuantizationSpec, QuantizedWeight

__all__ = ["quantize_weights", "QuantizedLinearWeight"]



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


def quantize_weights(
    ep: ExportedProgram,
    example_inputs: Sequence[torch.Tensor],
    scheme: str,
    group_size: int | None = None,
    sources: Mapping[str, list[str]] | None = None,
    stored: Mapping[str, QuantizedTensors] | None = None,
    others: bool = True,
    lm_head: str | None = None,
) -> PassResult[QuantizationSpec | None]:
    """Quantize every linear's weight as ``scheme`` (``group_size`` for int4). ``sources``: the
    model parameters each program weight was made of where that is not the weight itself (the
    fused ones, from :func:`~offgraph_export.passes.fuse_projections.fuse_projections`). ``stored``:
    weights quantized already, by model parameter name (the module docstring); ``others``: whether
    the linears ``stored`` does not name are quantized too; ``lm_head``: the last linear's own
    scheme (``int8``, ``int4`` in ``group_size``, or ``none``: float), None for ``scheme``."""
    if scheme == "8da4w":  # torchao's form, for XNNPACK
        from offgraph_export.passes.quantize_8da4w import quantize_8da4w

        if lm_head is not None:
            raise ExportError("8da4w stores every linear as 8da4w; --quantize-lm-head applies to --quantize int8 or int4")

        assert group_size is not None
        return quantize_8da4w(ep, example_inputs, group_size, sources)
    gm = ep.module()
    groups = weight_linears(gm)
    if not groups:
        return PassResult(ep, modified=False, produced=None)
    graph = gm.graph
    head = None
    if lm_head not in (None, scheme):
        found = last_linear_weight(gm, groups)
        if found is None or not found[1]:
            raise ExportError(
                f"--quantize-lm-head {lm_head}: the program's last linear "
                f"({found[0] if found else 'none'}) does not produce its output, so it is not the lm_head; the model computes "
                "its output projection otherwise: drop --quantize-lm-head"
            )
        head = found[0]
    given = dict(stored or {})
    records: list[QuantizedWeight] = []
    replaced: set[str] = set()
    used: set[int] = set()
    for target, linears in groups.items():
        weight = attr_tensor(gm, linears[0].args[1])
        assert weight is not None
        names = list((sources or {}).get(target, [target]))
        own = lm_head if target == head else None
        if own == "none":
            if any(n in given for n in names):
                raise ExportError(f"{target} (the lm_head) arrived quantized; --quantize-lm-head none cannot leave it float")
            continue
        weight_scheme = own or scheme
        weight_group = group_size if weight_scheme in GROUPED_SCHEMES else None
        if any(n in given for n in names):
            form = _given_form(target, weight, names, given, weight_scheme, weight_group)
            used.update(id(given[n]) for n in names)
        elif not others:
            continue
        else:
            try:
                form = quantize(weight, weight_scheme, weight_group, name=target)
            except OffgraphError as exc:
                flag = f"--quantize-lm-head {own}" if own else f"--quantize {scheme}"
                raise ExportError(f"{flag}: {exc}") from None
        index = len(records)
        shared = read_elsewhere(gm, target, linears)
        module_name = f"offgraph_quant_{index}"
        gm.add_submodule(module_name, QuantizedLinearWeight(form, weight.dtype))
        with graph.inserting_before(linears[0]):
            dequantized = graph.call_module(module_name, ())
        for node in linears:
            node.replace_input_with(node.args[1], dequantized)
        records.append(QuantizedWeight(name=target, sources=names, shape=list(weight.shape), shared=shared, scheme=own))
        replaced.add(target)
    unread = sorted(n for n, form in given.items() if id(form) not in used)
    if unread:
        raise ExportError(
            f"{unread[0]} arrived quantized, but the program does not read it as a linear's weight (aten.linear(x, W)): "
            "it would be stored float; only linear weights are stored quantized (design section 11)"
        )
    if not records:
        return PassResult(ep, modified=False, produced=None)
    grouped = any((r.scheme or scheme) in GROUPED_SCHEMES for r in records)
    spec = QuantizationSpec(scheme=scheme, group_size=group_size if grouped else None, weights=records)  # type: ignore[arg-type]
    return PassResult(retrace_rewritten(gm, ep, example_inputs, replaced, "quantized weights"), modified=True, produced=spec)


def _given_form(
    target: str, weight: torch.Tensor, names: list[str], given: Mapping[str, QuantizedTensors], scheme: str,
    group_size: int | None,
) -> QuantizedTensors:
    """The stored form of program weight ``target`` made of model parameters ``names``, all of
    them quantized already: theirs joined row-wise, checked to be ``scheme`` and to dequantize to
    the program's float values (the ``W'`` it was traced with)."""
    missing = [n for n in names if n not in given]
    if missing:
        have = [n for n in names if n in given]
        raise ExportError(
            f"{target} fuses {', '.join(names)}: {', '.join(have)} arrived quantized but {', '.join(missing)} did not; "
            "quantize them alike, or export with --no-fuse-projections"
        )
    parts = [given[n] for n in names]
    for name, part in zip(names, parts):
        if part.scheme != scheme or part.group_size != group_size:
            raise ExportError(f"{name} arrived quantized as {part.scheme}, but this export stores {scheme}")
    form = parts[0] if len(parts) == 1 else QuantizedTensors(
        scheme,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        None if parts[0].zeros is None else torch.cat([p.zeros for p in parts if p.zeros is not None]),
        parts[0].group_size,
    )
    if form.scales.dtype != weight.dtype or not torch.equal(dequantize(form), weight):
        raise ExportError(f"{target}: the program's weight is not the W' of the quantized {', '.join(names)} it was traced with")
    return form
