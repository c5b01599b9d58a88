"""``offgraph::dequantize_weight``: a quantized linear's float weight, as one node.

Why a node of its own: the quantize pass (``passes/quantize_weights.py``) puts it where a linear's
weight was, and passes that run before ``functionalize`` see one call with the stored constants
as arguments (the decode GEMV takes them into its kernel and dequantizes in registers) instead of
a chain of casts and multiplies to pattern-match. ``functionalize`` decomposes what is left of it
into aten ops (:data:`DECOMPOSITIONS`), so AOTInductor compiles it like any pointwise code and
no package calls the op by name. Eagerly it is the rule itself,
:func:`~offgraph_export.reference.weight_quant.dequantize_graph`.
"""

from __future__ import annotations

from typing import Optional

import torch

from offgraph_export.reference.weight_quant import dequantize_graph

__all__ = ["dequantize_weight", "DECOMPOSITIONS"]


def _aten_form(qweight, scales, zeros, group_size, dtype):
    """The op in aten ops: its eager body and its decomposition."""
    return dequantize_graph(qweight, scales, zeros, group_size or None, dtype)


@torch.library.custom_op("offgraph::dequantize_weight", mutates_args=())
def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int, dtype: torch.dtype,
) -> torch.Tensor:
    """``W'`` of the stored form (int8: ``zeros`` None, ``group_size`` 0; int4: both given)."""
    return _aten_form(qweight, scales, zeros, group_size, dtype)


@dequantize_weight.register_fake
def _(qweight, scales, zeros, group_size, dtype):
    k = qweight.shape[1] * (2 if zeros is not None else 1)
    return qweight.new_empty((qweight.shape[0], k), dtype=dtype)


#: what ``functionalize`` decomposes into aten ops before lowering
DECOMPOSITIONS = {torch.ops.offgraph.dequantize_weight.default: _aten_form}
