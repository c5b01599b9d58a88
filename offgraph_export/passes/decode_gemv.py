"""Route the decode method's one-row projections to the Triton GEMV kernel.

Why: in the decode method (width fixed at 1) every projection is a matrix-vector product, and the
compiler's GEMM templates run the narrow ones (output width <= 8192: q/k/v, output and down
projections of a Llama-shaped model) on fewer programs than the GPU has SMs
(:mod:`offgraph_export.lowering.triton_gemv` says what was measured). This pass rewrites each
``aten.linear(x, w)`` without bias whose input is one static row and whose weight is a row-major
cuda parameter or constant of at most :data:`~offgraph_export.lowering.triton_gemv.MAX_GEMV_ROWS`
rows into the
``offgraph_lowered::triton_gemv`` op; wider ones keep the compiler's GEMM. The node keeps its
inputs and output, so the graph signature is unchanged. Run it on the decode method before
``functionalize`` (which decomposes the op into its kernel). Produces how many linears it rewrote.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from offgraph_export.passes.result import PassResult

__all__ = ["decode_gemv"]


def _weight_names(ep: ExportedProgram) -> set[str]:
    sig = ep.graph_signature
    return {*sig.inputs_to_parameters, *sig.inputs_to_buffers, *sig.inputs_to_lifted_tensor_constants}


def _is_gemv_site(node: torch.fx.Node, weights: set[str], device_types: tuple[str, ...]) -> bool:
    from offgraph_export.lowering.triton_gemv import gemv_applies

    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
        return False
    if len(node.args) > 2 and node.args[2] is not None:
        return False
    x, w = node.args[0], node.args[1]
    if not (isinstance(w, torch.fx.Node) and w.op == "placeholder" and w.name in weights):
        return False
    xv, wv = x.meta.get("val"), w.meta.get("val")
    if xv is None or wv is None or xv.dtype != wv.dtype or wv.device.type not in device_types:
        return False
    if wv.dim() != 2 or wv.stride(1) != 1:
        return False  # the kernel reads row-major weights
    return gemv_applies(tuple(xv.shape), tuple(wv.shape))


def decode_gemv(ep: ExportedProgram, device_types: tuple[str, ...] = ("cuda",)) -> PassResult[int]:
    """Rewrite one-row linears of ``ep`` (in place) to the GEMV op; see the module docstring.
    ``device_types``: where the kernel may run; a GPU kernel, so cuda (the Triton interpreter also
    runs it on cpu tensors, which the tests use)."""
    import offgraph_export.lowering.triton_gemv  # noqa: F401  (defines the op)

    weights = _weight_names(ep)
    sites = [n for n in ep.graph.nodes if _is_gemv_site(n, weights, device_types)]
    for node in sites:
        node.target = torch.ops.offgraph_lowered.triton_gemv.default
        node.args = node.args[:2]
        node.kwargs = {}
    if sites:
        ep.graph_module.recompile()
    return PassResult(ep, modified=bool(sites), produced=len(sites))
