"""Route a cpu program's int8 linears in bf16 or fp16 to torch's int8 weight-only CPU kernel.

Why: a quantized linear computes from ``offgraph::dequantize_weight`` (design section 11), which
the compiler turns into a kernel that writes the float weight ``W'`` out again every step, then the
matmul reads it: on a cpu a quantized decode step is slower than the float one. torch's
``aten._weight_int8pack_mm(x [M, K], q [N, K] int8, scales [N])`` reads the stored bytes and applies
the scale per row after the sum, and AOTInductor's CPU C shim declares it (torch 2.13). Measured on
the dev CPU (``benchmarks/cpu-2026-12-07-int8pack/``, eager, one row, SmolLM2-135M shapes): 2.6-4.2x
faster than the bf16 linear itself (lm_head 0.97 against 4.04 ms), tens of times faster than
dequantize + linear; in fp32 slower than the fp32 linear (no fast path), and in bf16 slower than
the bf16 linear from 16 rows up (gate|up at 64 rows 1.56 against 0.70 ms): so only bf16 and fp16
weights are taken, and only one-row steps gain. Not applied on a ``.pte`` (ExecuTorch), nor on
cuda (the decode GEMV takes quantized weights there).

Each ``aten.linear(x, offgraph::dequantize_weight(q, s, None, 0, dt)[, b])`` with an int8 weight
(no zeros, no group) whose dtype ``dt`` and ``x``'s are bf16 or fp16 becomes ``view(x, [-1, K])``
-> ``_weight_int8pack_mm`` -> ``view`` to ``x``'s leading dims (at most one of them symbolic: the
step's width) and ``N`` [-> ``add`` of the bias]; the dequantize node goes once nothing reads it.
The result differs from the linear over ``W'`` by rounding only (the scale applied to the fp32 sum
instead of to each weight rounded to ``dt``), as the cuda GEMV's does. The program's inputs and
outputs are unchanged. Produces how many linears were rewritten.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.export import ExportedProgram

from offgraph_export.compat import program_copy
from offgraph_export.passes.graph_utils import (
    dequantized_weight_args, drop_dead, linear_to_rows_kernel, rows_linear_site, tensor_value, weight_names,
)
from offgraph_export.passes.result import PassResult

__all__ = ["cpu_int8_linear", "TAKEN_DTYPES"]

aten = torch.ops.aten
#: the activation and weight dtypes whose int8 linears go to the kernel (fp32 has no fast path)
TAKEN_DTYPES = (torch.bfloat16, torch.float16)


def _int8_weight(w: object, weights: set[str]) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(qweight, scales)`` when ``w`` is ``offgraph::dequantize_weight`` of an int8 weight (no
    zeros, no group) in a taken dtype, stored as int8 ``[N, K]`` and ``[N]`` scales of that dtype."""
    found = dequantized_weight_args(w, weights)
    if found is None:
        return None
    qweight, scales, zeros, group_size = found
    dtype = w.args[4]
    q, s = tensor_value(qweight), tensor_value(scales)
    if zeros is not None or group_size or dtype not in TAKEN_DTYPES or s is None:
        return None
    if q.dtype != torch.int8 or s.dtype != dtype or s.dim() != 1:
        return None
    return qweight, scales


def _site(node: torch.fx.Node, weights: set[str]) -> Optional[tuple[Any, ...]]:
    """``(x, qweight, scales, bias, leading sizes)`` when ``node`` is a linear the pass takes."""
    return rows_linear_site(node, lambda w: _int8_weight(w, weights))


def cpu_int8_linear(ep: ExportedProgram) -> PassResult[int]:
    """The module docstring's rewrite, on a copy of ``ep`` sharing its weights (``ep`` is an
    earlier pass's result, which the decode method is traced from again); ``produced``: the
    linears rewritten. A program with none is returned as it is."""
    weights = weight_names(ep)
    if not any(_site(node, weights) for node in ep.graph.nodes):
        return PassResult(ep, modified=False, produced=0)
    ep = program_copy(ep)
    graph = ep.graph
    rewritten = 0
    for node in list(graph.nodes):
        site = _site(node, weights)
        if site is None:
            continue
        x, qweight, scales, bias, lead = site
        n, k = tensor_value(qweight).shape
        linear_to_rows_kernel(ep, node, x, bias, lead, k, n, aten._weight_int8pack_mm.default, (qweight, scales))
        rewritten += 1
    drop_dead(graph)
    graph.lint()
    ep.graph_module.recompile()
    return PassResult(ep, modified=True, produced=rewritten)
