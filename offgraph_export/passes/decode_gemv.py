"""Route the decode method's one-row projections to the Triton GEMV kernel, folding in the
norm before them and the SiLU·mul and residual add after them.

Why: in the decode method (width fixed at 1) every projection is a matrix-vector product, and the
compiler's GEMM templates run the narrow ones (output width <= 8192: q/k/v, output and down
projections of a Llama-shaped model) on fewer programs than the GPU has SMs
(:mod:`offgraph_export.kernels.triton_gemv` says what was measured). At one token the step is
also bound by launches: every RMSNorm, SiLU·mul and residual add is a kernel of its own, about 5
per layer. This pass rewrites each ``aten.linear(x, w[, b])`` whose input is one static
row and whose weight is a row-major cuda parameter or constant into the
``offgraph_lowered::triton_gemv`` op, and takes into that one node, where the graph has them:

* the RMSNorm producing ``x`` (``w_n * cast(xf * rsqrt(mean(xf ** 2, -1) + eps))``, ``xf`` the
  input in fp32: the eager pattern of Llama-family models), as the kernel's prologue, also where
  a slice that keeps the whole tensor stands between them (transformers' final norm and lm_head);
* a ``silu(gate) * up`` reading the two halves of a gate|up projection (as
  :mod:`~offgraph_export.passes.fuse_projections` splits it), as the gated epilogue; the
  projection may then be up to twice :data:`~offgraph_export.kernels.triton_gemv.MAX_GATED_ROWS`
  wide;
* an ``add`` of another tensor of the output's shape and dtype, as the residual epilogue.

A linear whose weight is ``offgraph::dequantize_weight`` of stored constants (a quantized
weight, design section 11) is taken too, at any width: the GEMV reads the stored form and
dequantizes in registers (the compiler's kernels would write the float weight out every step),
and the dequantize node goes once nothing else reads it.

A pattern is folded only when every value inside it has no other user, its dtypes are the ones
the kernel rounds to, and nothing between its first node and its last writes memory (the rewritten
node reads its inputs where the last one ran). The kernel then performs the same operations with
the same roundings as the nodes it replaces; results differ only by summation order and the
kernel's fp32 ``exp``/``rsqrt``/division. Wider
linears and anything that does not match keep the compiler's kernels. The program's inputs and
outputs are unchanged. Run it on the decode method before ``functionalize`` (which decomposes the
op into its kernel). Produces a :class:`GemvCounts`: how many linears were rewritten and how many
of each fold fired.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.export import ExportedProgram

from offgraph_export.passes.graph_utils import (
    binary_operands, dequantized_weight_args, drop_dead, is_call, no_write_between, only_user, replace_node, tensor_value,
    users, weight_names,
)
from offgraph_export.passes.result import PassResult

__all__ = ["decode_gemv", "GemvCounts"]

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)
#: the keyword of each split op's sizes argument
_SIZE_KWARG = {aten.split_with_sizes.default: "split_sizes", aten.split.Tensor: "split_size", aten.chunk.default: "chunks"}


@dataclass(frozen=True)
class GemvCounts:
    """What :func:`decode_gemv` rewrote: ``linears`` GEMV nodes, of which ``norms`` took their
    RMSNorm, ``gated`` their SiLU·mul, ``residuals`` their residual add and ``quantized`` read a
    quantized weight's stored form."""

    linears: int = 0
    norms: int = 0
    gated: int = 0
    residuals: int = 0
    quantized: int = 0


@dataclass
class _Site:
    linear: torch.fx.Node
    x: torch.fx.Node
    weight: torch.fx.Node
    #: a quantized weight's (scales, zeros, group_size); ``weight`` is then its stored ``qweight``
    quant: Optional[tuple[torch.fx.Node, Optional[torch.fx.Node], int]] = None
    #: the linear's bias (a 1-D weight of the output's width), added in the kernel
    bias: Optional[torch.fx.Node] = None
    norm: Optional[tuple[torch.fx.Node, float]] = None  # (norm weight, eps)
    gate_first: Optional[bool] = None  # set when the gated epilogue applies
    residual: Optional[torch.fx.Node] = None
    last: Optional[torch.fx.Node] = None  # the node the rewritten one replaces


# -- small predicates -----------------------------------------------------------------------------


def _cast_source(node: torch.fx.Node, dtype: torch.dtype) -> Optional[torch.fx.Node]:
    """The input of ``node`` when it is a plain dtype cast to ``dtype`` (nothing else changed)."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    if node.target is aten.to.dtype:
        ok = len(node.args) == 2 and node.args[1] == dtype and not node.kwargs
    else:
        ok = len(node.args) == 1 and set(node.kwargs) <= {"dtype"} and node.kwargs.get("dtype") == dtype
    src = node.args[0]
    return src if ok and isinstance(src, torch.fx.Node) else None


# -- the patterns ---------------------------------------------------------------------------------


def _match_rmsnorm(
    z: torch.fx.Node, weights: set[str]
) -> Optional[tuple[torch.fx.Node, torch.fx.Node, float, torch.fx.Node]]:
    """``(x, norm weight, eps, first node of the pattern)`` when ``z`` is
    ``w_n * cast(xf * rsqrt(mean(xf ** 2, [-1], keepdim) + eps))`` with ``xf`` the fp32 ``x`` (a cast
    or ``x`` itself), every value used only inside the pattern, ``w_n`` a 1-D weight and ``z`` of
    ``w_n``'s dtype."""
    zv, z_ops = tensor_value(z), binary_operands(z, aten.mul.Tensor)
    if zv is None or z_ops is None:
        return None
    dt, k = zv.dtype, zv.shape[-1]
    for w_n, y in (z_ops, z_ops[::-1]):
        wv = tensor_value(w_n)
        if not (isinstance(w_n, torch.fx.Node) and w_n.op == "placeholder" and w_n.name in weights):
            continue
        if wv is None or wv.dtype != dt or tuple(wv.shape) != (k,) or not isinstance(y, torch.fx.Node):
            continue
        m = _cast_source(y, dt) or y  # an fp32 model may keep the (no-op) cast or not
        if only_user(y) is not z or (m is not y and only_user(m) is not y):
            continue
        m_ops = binary_operands(m, aten.mul.Tensor)
        if m_ops is None or tensor_value(m).dtype != torch.float32:
            continue
        if m is y and dt != torch.float32:
            continue
        for xf, r in (m_ops, m_ops[::-1]):
            found = _match_rstd(r, xf)
            if found is None or tensor_value(xf) is None or tensor_value(xf).dtype != torch.float32:
                continue
            x = _cast_source(xf, torch.float32) or xf
            xv = tensor_value(x)
            if xv is None or xv.dtype not in (dt, torch.float32) or xv.shape != zv.shape:
                continue
            eps, first = found
            return x, w_n, eps, (xf if x is not xf else first)
    return None


def _match_rstd(r: object, xf: object) -> Optional[tuple[float, torch.fx.Node]]:
    """``(eps, pow node)`` when ``r`` is ``rsqrt(mean(xf ** 2, [-1], keepdim=True) + eps)``, used
    only by its consumer."""
    if not is_call(r, aten.rsqrt.default) or only_user(r) is None:
        return None
    s = r.args[0]
    s_ops = binary_operands(s, aten.add.Tensor)
    if s_ops is None or only_user(s) is not r:
        return None
    a, b = s_ops
    mean, eps = (a, b) if isinstance(b, float) else (b, a)
    if not isinstance(eps, float) or not is_call(mean, aten.mean.dim) or only_user(mean) is not s:
        return None
    rank = tensor_value(xf).dim() if tensor_value(xf) is not None else None
    dims = mean.args[1] if len(mean.args) > 1 else None
    keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if rank is None or keep is not True or list(dims or []) not in ([-1], [rank - 1]) or "dtype" in mean.kwargs:
        return None
    p = mean.args[0]
    if not is_call(p, aten.pow.Tensor_Scalar) or p.args[0] is not xf or p.args[1] != 2 or only_user(p) is not mean:
        return None
    return eps, p


def _whole_slice_source(x: object) -> Optional[torch.fx.Node]:
    """The sliced tensor when ``x`` is an ``aten.slice`` that keeps all of it (step 1, the same
    shape: transformers' ``hidden_states[:, -logits_to_keep:]`` with ``logits_to_keep = 0``, between
    the final norm and the lm_head), else None. The shapes are compared as they stand: concrete in
    the width-specialized decode method this pass runs on."""
    if not is_call(x, aten.slice.Tensor):
        return None
    src, step = x.args[0], (x.args[4] if len(x.args) > 4 else x.kwargs.get("step", 1))
    sv, xv = tensor_value(src), tensor_value(x)
    if not isinstance(src, torch.fx.Node) or sv is None or xv is None or step != 1:
        return None
    return src if tuple(sv.shape) == tuple(xv.shape) else None


def _match_gated(linear: torch.fx.Node) -> Optional[tuple[torch.fx.Node, bool]]:
    """``(mul, gate_first)`` when the linear's only use is ``silu(half) * other_half`` of its
    output split in two equal halves on the last dim (``split_with_sizes``, ``split``, ``chunk``)."""
    split = only_user(linear)
    n = tensor_value(linear).shape[-1]
    kinds = {aten.split_with_sizes.default: [n // 2, n // 2], aten.split.Tensor: n // 2, aten.chunk.default: 2}
    if split is None or n % 2 or split.op != "call_function" or split.target not in kinds:
        return None
    sizes = split.args[1] if len(split.args) > 1 else split.kwargs.get(_SIZE_KWARG[split.target])
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if isinstance(sizes, (list, tuple)):
        sizes = list(sizes)
    if sizes != kinds[split.target] or dim not in (-1, tensor_value(linear).dim() - 1):
        return None
    halves = {}
    for g in users(split):
        if g.target is not operator.getitem:
            return None
        halves[g.args[1]] = g
    if set(halves) != {0, 1}:
        return None
    for gate_index in (0, 1):
        gate, up = halves[gate_index], halves[1 - gate_index]
        act = only_user(gate)
        if act is None or not is_call(act, aten.silu.default) or len(act.args) != 1:
            continue
        mul = only_user(act)
        if mul is None or not is_call(mul, aten.mul.Tensor) or only_user(up) is not mul:
            continue
        if set(binary_operands(mul, aten.mul.Tensor) or ()) != {act, up} or tensor_value(mul).dtype != tensor_value(linear).dtype:
            continue
        return mul, gate_index == 0
    return None


def _match_residual(out: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(add, residual)`` when ``out``'s only use is ``out + residual`` (either order) with both of
    the same shape and dtype."""
    add = only_user(out)
    add_ops = binary_operands(add, aten.add.Tensor) if add is not None else None
    if add_ops is None:
        return None
    a, b = add_ops
    other = b if a is out else a
    ov, rv, av = tensor_value(out), tensor_value(other), tensor_value(add)
    if other is out or rv is None or av is None:
        return None
    if rv.shape != ov.shape or rv.dtype != ov.dtype or av.dtype != ov.dtype:
        return None
    return add, other


def _site(
    node: torch.fx.Node, weights: set[str], device_types: tuple[str, ...], claimed: set[torch.fx.Node]
) -> Optional[_Site]:
    """The GEMV site at ``node`` with its folds, or None. ``claimed``: nodes earlier sites
    replace (a residual ``add`` of two linears is folded into the first of them only)."""
    from offgraph_export.kernels.triton_gemv import gemv_applies

    if not is_call(node, aten.linear.default):
        return None
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    x, w = node.args[0], node.args[1]
    quant = dequantized_weight_args(w, weights)
    if quant is None and not (isinstance(w, torch.fx.Node) and w.op == "placeholder" and w.name in weights):
        return None
    xv, wv = tensor_value(x), tensor_value(w)
    if xv is None or wv is None or xv.dtype != wv.dtype or wv.device.type not in device_types:
        return None
    if wv.dim() != 2 or (quant is None and wv.stride(1) != 1):
        return None  # the kernel reads row-major weights
    if bias is not None:
        bv = tensor_value(bias)
        if not (isinstance(bias, torch.fx.Node) and bias.op == "placeholder" and bias.name in weights):
            return None
        if bv is None or tuple(bv.shape) != (wv.shape[0],) or bv.dtype != wv.dtype:
            return None
    q = quant is not None
    plain = gemv_applies(tuple(xv.shape), tuple(wv.shape), quantized=q)
    gated = _match_gated(node) if gemv_applies(tuple(xv.shape), tuple(wv.shape), gated=True, quantized=q) else None
    normed = _whole_slice_source(x) or x  # transformers slices the final norm's output for the lm_head
    norm = _match_rmsnorm(normed, weights) if only_user(x) is node and only_user(normed) in (node, x) else None
    # the folds that apply, dropped last-first until no write lies inside the folded pattern
    for use_norm, use_gated, use_residual in itertools.product((1, 0), repeat=3):
        if (use_gated and gated is None) or (not use_gated and not plain):
            continue
        site = _Site(linear=node, x=x, weight=w, last=node, bias=bias)
        if quant is not None:
            site.weight, site.quant = quant[0], quant[1:]
        if use_gated:
            site.last, site.gate_first = gated
        first = node
        if use_norm and norm is not None:
            site.x, norm_weight, eps, first = norm
            site.norm = (norm_weight, eps)
        residual = _match_residual(site.last) if use_residual else None
        if residual is not None and residual[0] not in claimed:
            site.last, site.residual = residual
        if no_write_between(first, site.last):
            return site
    return None


# -- the rewrite ----------------------------------------------------------------------------------


def decode_gemv(ep: ExportedProgram, device_types: tuple[str, ...] = ("cuda",)) -> PassResult[GemvCounts]:
    """Rewrite one-row linears of ``ep`` (in place) to the GEMV op with their folds; see the module
    docstring. ``device_types``: where the kernel may run; a GPU kernel, so cuda (the Triton
    interpreter also runs it on cpu tensors, which the tests use)."""
    import offgraph_export.kernels.triton_gemv  # noqa: F401  (defines the op)

    gemv = torch.ops.offgraph_lowered.triton_gemv.default
    weights = weight_names(ep)
    graph = ep.graph
    sites: list[_Site] = []
    claimed: set[torch.fx.Node] = set()
    for n in list(graph.nodes):
        site = _site(n, weights, device_types, claimed)
        if site is not None:
            sites.append(site)
            claimed.add(site.last)
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}  # sites were matched before any rewrite
    for site in sites:
        norm_weight, eps = site.norm if site.norm else (None, 0.0)
        scales, zeros, group = site.quant if site.quant else (None, None, 0)
        args = (site.x, site.weight, norm_weight, eps, site.residual, site.gate_first is not None,
                site.gate_first is not False, scales, zeros, group, site.bias)
        args = tuple(replaced.get(a, a) if isinstance(a, torch.fx.Node) else a for a in args)
        with graph.inserting_before(site.last):
            node = graph.call_function(gemv, args)
        node.meta = dict(site.last.meta)
        replace_node(ep, site.last, node)
        replaced[site.last] = node
    if sites:
        drop_dead(graph)
        graph.lint()
        ep.graph_module.recompile()
    counts = GemvCounts(
        linears=len(sites),
        norms=sum(s.norm is not None for s in sites),
        gated=sum(s.gate_first is not None for s in sites),
        residuals=sum(s.residual is not None for s in sites),
        quantized=sum(s.quant is not None for s in sites),
    )
    return PassResult(ep, modified=bool(sites), produced=counts)
