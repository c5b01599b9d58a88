"""Triton lowered step for CUDA: write this step's K/V rows into storage in place, then attend over
the valid rows only, reading nothing beyond them.

Same contract as :func:`offgraph_export.kernels.portable.portable_update_and_attend` (the
reference semantics); see docs/design.md, "The lowered step". Why kernels rather than aten: the portable
step scores every storage row and masks afterwards, so its cost grows with the *capacity*; these
kernels take their loop bounds from the positions (read on the device), so a decode step costs what
the live history costs.

How it is put together
----------------------
* One custom op, ``offgraph_lowered::triton_update_and_attend``, made with
  ``torch.library.triton_op`` and declared to mutate ``k_store``/``v_store``. ``torch.export``
  keeps it as one node; AOTInductor traces into it and compiles the kernels (launched through
  ``torch.library.wrap_triton``) into the package, so the compiled step never calls Python.
* Host code only does shape arithmetic: every size may be a SymInt during export (the token width
  ``T`` and the flat storage's ``rows`` are dynamic), so grids are plain integer expressions and
  there is no Python control flow on tensor values. Positions are read inside the kernels (no
  ``.item()``: the step is compiled ahead of time and may be replayed as a CUDA graph).
* Any strides: the kernels take every stride of q/k/v/position as arguments, but those are numbers
  fixed when the op is decomposed at export, while AOTInductor may hand the kernels the same
  tensors in another layout (its decompositions may re-derive an intermediate's strides: ``cat``
  whose other inputs are empty becomes a stride-preserving ``clone``, so the rotated q of a fused
  q|k|v projection arrives transposed where export saw it contiguous). So the host code first
  copies them into the one layout their shape has (:func:`~offgraph_export.kernels.portable.dense_copy`,
  an op every trace keeps, which Inductor fuses into the producer where it can): the strides
  passed then hold in any trace. A one-token step is left uncopied: its kernels read only the head
  and head-dim strides, which the views making q/k/v fix, and on the decode path a copy would be
  a kernel per tensor per layer.
* Two families of kernels, split as Inductor splits its flex-attention kernels: a step whose ``T``
  is the constant 1 (the decode method, an eager one-token call) takes the one-token family
  (:mod:`~offgraph_export.kernels.attend_decode`: attend with the row write folded in, then
  combine); any other step the multi-token family (:mod:`~offgraph_export.kernels.attend_prefill`:
  row writes, then a split-K or a tiled attention chosen by complementary grids, and a combine).
  What they share, jit helpers and the launch configuration, is in
  :mod:`~offgraph_export.kernels.attend_common`. This module is the op: its checks, the choice of
  family and the registration.
"""

from typing import Optional

import torch

from offgraph_export.errors import ExportError
from offgraph_export.kernels.attend_common import AttendLaunch, attention_output, rope_rows
from offgraph_export.kernels.attend_decode import decode_step
from offgraph_export.kernels.attend_prefill import prefill_step
from offgraph_export.kernels.portable import dense_copy
from offgraph_export.kernels.triton_base import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from offgraph_export.reference.cache import softcap_problem

__all__ = ["triton_update_and_attend", "OP_NAME"]

OP_NAME = "offgraph_lowered::triton_update_and_attend"


def _lowered_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    window: Optional[int],
    scale: float,
    out_dtype: torch.dtype,
    rope_cos: Optional[torch.Tensor] = None,
    rope_sin: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Body of the triton_op (``window`` None: a flat layer). ``rope_cos``/``rope_sin``: the
    step's rotary rows (one position, ``D`` values each, q's dtype); q and k then arrive
    unrotated and a one-token step rotates them in its kernel (``passes/decode_rope.py``).
    ``softcap``/``sinks``: design section 2 (``sinks`` ``[Hq]``, unit stride, as a parameter)."""
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    rows = k_store.shape[2]
    torch._check(hq % hkv == 0, lambda: f"Hq={hq} must be a multiple of Hkv={hkv}")
    torch._check(k.shape[2] == t, lambda: "k must have as many tokens as q")
    torch._check(v.shape[2] == t, lambda: "v must have as many tokens as q")
    torch._check(v_store.shape[2] == rows, lambda: "k_store and v_store must have equal rows")
    torch._check(
        k_store.stride(-1) == 1 and v_store.stride(-1) == 1,
        lambda: "storage rows must be contiguous (last-dim stride 1)",
    )
    one_token = isinstance(t, int) and t == 1
    if one_token:
        # One token: the kernels use only the head and head-dim strides, which the views that make
        # q/k/v fix in any trace (the token dim has size 1); no copy on the decode path.
        pos = position.reshape(-1)
    else:
        # The kernels are given these tensors' strides as numbers fixed at export: copy them into
        # the one layout of their shape, so those numbers hold whatever layout compiling gives them.
        q, k, v = dense_copy(q), dense_copy(k), dense_copy(v)
        pos = dense_copy(position).reshape(-1)
    torch._check(pos.shape[0] == t, lambda: "position must hold one entry per token")
    if sinks is not None:
        torch._check(sinks.dim() == 1 and sinks.shape[0] == hq, lambda: f"sinks must have shape [{hq}]")
        torch._check(sinks.stride(0) == 1, lambda: "sinks must have unit stride")
    launch = AttendLaunch.for_step(q, k, v, k_store, v_store, window, scale, softcap, sinks is not None)
    d = launch.head_dim
    out = attention_output(b, hq, t, launch.v_dim, out_dtype, q.device)
    rope = rope_rows(rope_cos, rope_sin, q, k, d, one_token)
    if one_token:
        # A concrete one-token step (the decode method, or an eager call): its own kernels.
        return decode_step(q, k, v, pos, k_store, v_store, out, launch, rope, sinks=sinks)
    return prefill_step(q, k, v, pos, k_store, v_store, out, launch, sinks)


if _TRITON_IMPORT_ERROR is None:
    _lowered_step_op = torch.library.triton_op(OP_NAME, mutates_args={"k_store", "v_store"})(
        _lowered_step
    )


def triton_update_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    window: int | None,
    scale: float,
    out_dtype: torch.dtype,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's rows into ``k_store``/``v_store`` in place and attend over the valid rows.

    Same signature and semantics as ``portable_update_and_attend``: q ``[B,Hq,T,D]``, k
    ``[B,Hkv,T,D]``, v ``[B,Hkv,T,Dv]`` (any strides), position int64 ``[T]`` or ``[T,1]``,
    storage ``[B,Hkv,rows,D|Dv]``; ``window`` None is a flat layer, an int a ring attending the
    newest ``window`` positions (rows by :func:`offgraph_export.specs.manifest.storage_row`). Returns
    ``[B,Hq,T,Dv]`` in ``out_dtype``. Calls the ``offgraph_lowered::triton_update_and_attend`` op,
    so ``torch.export`` records one node and AOTInductor compiles its kernels. ``rope_cos``/
    ``rope_sin`` (one-token steps only): q and k are unrotated and the kernel applies the rotary
    embedding ``x * cos + rotate_half(x) * sin`` with these ``D``-value rows. ``softcap`` (a
    positive float) caps the scores before the mask; ``sinks`` (``[Hq]``) join each row's softmax
    (docs/design.md section 2).
    """
    if _TRITON_IMPORT_ERROR is not None:
        raise ExportError(
            "the triton step implementation needs the 'triton' package "
            f"(pip install offgraph-export[triton]); importing it failed: {_TRITON_IMPORT_ERROR}. "
            "Use the portable step instead."
        )
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ExportError(f"window must be None (flat) or a positive int, got {window!r}")
    problem = softcap_problem(softcap)
    if problem:
        raise ExportError(problem)
    return _lowered_step_op(
        q, k, v, position, k_store, v_store, window, float(scale),
        out_dtype, rope_cos, rope_sin, float(softcap) if softcap is not None else None, sinks,
    )
