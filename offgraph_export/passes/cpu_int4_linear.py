"""Route a cpu program's int4 linears in bf16 or fp16 to torch's int4 weight-only CPU kernel.

Why: as for int8 (:mod:`~offgraph_export.passes.cpu_int8_linear`), a quantized linear computes
from ``offgraph::dequantize_weight``, which the compiler turns into a kernel writing the float
weight ``W'`` out every step before the matmul reads it. torch's
``aten._weight_int4pack_mm_for_cpu(x [M, K], packed [N, K / 2] uint8, group, scales_and_zeros [K /
group, N, 2])`` reads 4-bit values in its own blocked layout (made by
``aten._convert_weight_to_int4pack_for_cpu`` from the ``[N, K]`` values) and computes ``((q - 8) *
scale + zero) . x`` per group: the stored form of design section 11 exactly. AOTInductor's CPU C
shim declares it (``aoti_torch_cpu__weight_int4pack_mm_cpu_tensor``, torch 2.13). Measured on the
dev CPU (``benchmarks/cpu-2026-12-08-int4pack/``, eager, one row, SmolLM2-135M shapes, group 32):
1.8-4.7x faster than the bf16 linear itself, 6-125x faster than dequantize + linear; slower than
the bf16 linear from 8 rows (as the int8 kernel), and in fp32 5-14x slower than the fp32 linear:
so only bf16 and fp16 weights are taken. The whole SmolLM2 decode step: 8.77 ms/token against
75.27 (dequantize + linear) and 25.53 (bf16) (``benchmarks/cpu-2026-12-08-int4-step/``). Not
applied on a ``.pte`` nor on cuda.

Each ``aten.linear(x, offgraph::dequantize_weight(q, s, z, group, dt)[, b])`` with an int4 weight
(``q`` uint8 ``[N, K / 2]`` two values a byte, ``s``/``z`` ``[N, K / group]`` in ``dt``) whose
dtype ``dt`` and ``x``'s are bf16 or fp16 and whose ``N`` is a multiple of 16 (the packing's
rule) becomes ``view(x, [-1, K])`` -> ``_weight_int4pack_mm_for_cpu`` -> ``view`` to ``x``'s
leading dims and ``N`` [-> ``add`` of the bias]. The packed weight and ``scales_and_zeros`` are new
buffers of the program (``<qweight's name>_cpu_int4pack`` and ``_cpu_int4_scales_zeros``),
made once per export from the stored tensors (``packed``: give the same dict to the general and
the decode method's calls, so both hold the same tensors and the package stores them once); the
stored ``q``, ``s``, ``z`` and the dequantize node go once nothing reads them. The result differs
from the linear over ``W'`` by rounding only (``W'`` never rounded to ``dt``, the kernel's own
summation). The program's inputs and outputs are unchanged. Produces how many linears were
rewritten.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional

import torch
from torch.export import ExportedProgram

from offgraph_export.compat import program_copy
from offgraph_export.errors import ExportError
from offgraph_export.passes.cpu_int8_linear import TAKEN_DTYPES
from offgraph_export.passes.graph_utils import (
    add_buffer, dequantized_weight_args, drop_dead, linear_to_rows_kernel, rows_linear_site, tensor_value, weight_names,
    weight_target, weight_tensor,
)
from offgraph_export.passes.result import PassResult
from offgraph_export.specs.quantization import GROUP_SIZES

__all__ = ["cpu_int4_linear", "KERNEL_GROUPS"]

aten = torch.ops.aten
#: the group sizes the kernel takes (it also takes 256, which no export makes)
KERNEL_GROUPS = GROUP_SIZES
#: ``_convert_weight_to_int4pack_for_cpu``'s rule: rows a multiple of this
_ROW_MULTIPLE = 16
#: the packing's inner tiles argument (its CPU form does not use it; 2 as torchao passes)
_INNER_K_TILES = 2


def _int4_weight(w: object, weights: set[str]) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, int]]:
    """``(qweight, scales, zeros, group)`` when ``w`` is ``offgraph::dequantize_weight`` of an int4
    weight in a taken dtype, in the stored form the kernel's packing takes."""
    found = dequantized_weight_args(w, weights)
    if found is None:
        return None
    qweight, scales, zeros, group = found
    dtype = w.args[4]
    if zeros is None or group not in KERNEL_GROUPS or dtype not in TAKEN_DTYPES:
        return None
    q, s, z = tensor_value(qweight), tensor_value(scales), tensor_value(zeros)
    if q is None or s is None or z is None or q.dtype != torch.uint8:
        return None
    n, half = q.shape
    if n % _ROW_MULTIPLE or (2 * half) % group or tuple(s.shape) != (n, 2 * half // group):
        return None
    if s.dtype != dtype or z.dtype != dtype or tuple(z.shape) != tuple(s.shape):
        return None
    return qweight, scales, zeros, group


def _site(node: torch.fx.Node, weights: set[str]) -> Optional[tuple[Any, ...]]:
    """``(x, qweight, scales, zeros, group, bias, leading sizes)`` when ``node`` is a linear the pass takes."""
    return rows_linear_site(node, lambda w: _int4_weight(w, weights))


def pack_for_cpu(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(packed [N, K / 2] uint8, scales_and_zeros [K / group, N, 2])`` from the stored
    form (low nibble: even column)."""
    values = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1).to(torch.int32)
    packed = aten._convert_weight_to_int4pack_for_cpu(values, _INNER_K_TILES)
    return packed, torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()


def cpu_int4_linear(
    ep: ExportedProgram, packed: MutableMapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> PassResult[int]:
    """The module docstring's rewrite, on a copy of ``ep`` sharing its weights (``ep`` is an
    earlier pass's result, which the decode method is traced from again) with a state dict of
    its own. ``packed``: the kernel's tensors by stored weight name, filled and reused (one
    dict per export, shared by its methods). ``produced``: the linears rewritten."""
    weights = weight_names(ep)
    if not any(_site(node, weights) for node in ep.graph.nodes):
        return PassResult(ep, modified=False, produced=0)
    packed = {} if packed is None else packed
    source = ep
    ep = program_copy(ep, own_weights=True)
    graph = ep.graph
    made: dict[str, tuple[torch.fx.Node, torch.fx.Node]] = {}
    rewritten = 0
    for node in list(graph.nodes):
        site = _site(node, weights)
        if site is None:
            continue
        x, qweight, scales, zeros, group, bias, lead = site
        target = weight_target(source, qweight)
        stored = [weight_tensor(source, n) for n in (qweight, scales, zeros)]
        if target not in packed:
            packed[target] = (stored[0], *pack_for_cpu(*stored))
        elif packed[target][0] is not stored[0]:  # another method's weight of that name: not this one's packing
            raise ExportError(f"weight {target!r} differs between the methods; its int4 CPU packing cannot be shared")
        if target not in made:
            made[target] = (add_buffer(ep, f"{target}_cpu_int4pack", packed[target][1]),
                            add_buffer(ep, f"{target}_cpu_int4_scales_zeros", packed[target][2]))
        w_node, sz_node = made[target]
        n, k = tensor_value(qweight).shape[0], 2 * tensor_value(qweight).shape[1]
        linear_to_rows_kernel(ep, node, x, bias, lead, k, n, aten._weight_int4pack_mm_for_cpu.default, (w_node, group, sz_node))
        rewritten += 1
    drop_dead(graph)
    graph.lint()
    ep.graph_module.recompile()
    return PassResult(ep, modified=True, produced=rewritten)
