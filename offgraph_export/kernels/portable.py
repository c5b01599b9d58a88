"""Portable (aten-only) lowered step: write this step's K/V rows into storage in place, then
attend over the valid rows only. Serves the CPU (and CUDA, when asked for with ``--step-impl
portable``).

Storage is ``[B, Hkv, rows, D]``; the row of a position and the position a row holds come from
:mod:`offgraph_export.specs.manifest` (one rule for flat and ring layers). Rows never written may hold anything (the check poisons them with NaN),
so invalid rows are removed from the scores with ``where`` (not an additive mask) and zeroed in V
before the weighted sum: ``0 * NaN`` would otherwise leak into every output.

Any strides: q/k/v/position may arrive in any layout (a transposed slice of a fused q|k|v
projection, say), and the layout the step is traced with need not be the one it is compiled with:
Inductor's decompositions may give an intermediate other strides than export recorded (``cat``
whose other inputs are empty becomes a stride-preserving ``clone``). A ``reshape`` that merges
dims is recorded as a ``view`` where the traced layout allowed one, which then fails to compile
for the other layout. So every input the step reshapes is first copied by :func:`dense_copy` into
the one layout its shape has, by an op every trace keeps.

Soft-capping and sinks (docs/design.md section 2) are the reference cache's own functions
(:func:`~offgraph_export.reference.cache.soft_cap`, :func:`~offgraph_export.reference.cache.attention_probs`),
so the portable step and the oracle apply one rule.
"""

from __future__ import annotations

import torch

from offgraph_export.reference.cache import attention_probs, soft_cap
from offgraph_export.specs.manifest import row_position, storage_row

__all__ = ["dense_copy", "portable_update_and_attend"]


def dense_copy(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` (in ``dtype``) copied into the contiguous layout of its shape, whatever its strides.

    Always a copy (``_to_copy`` with an explicit memory format), so its layout depends on the
    shape alone in every trace; ``.contiguous()`` (or ``.float()`` of an fp32 tensor) is no op at
    all where the traced tensor already is contiguous, and then what follows it inherits whatever
    layout the compiler gives the input. Views and kernels' stride arguments taken from the copy
    hold in any trace."""
    return x.to(dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)


def portable_update_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    window: int | None,
    scale: float,
    out_dtype: torch.dtype,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the step's rows, then attend (fp32) over the valid rows; ``softcap`` caps the scores
    before the mask, ``sinks [Hq]`` join each row's softmax (design section 2)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    rows = k_store.shape[2]
    pos = position.reshape(-1)
    write_rows = storage_row(pos, rows)
    k_store.index_copy_(2, write_rows, k.to(k_store.dtype))
    v_store.index_copy_(2, write_rows, v.to(v_store.dtype))

    # Absolute position held by each storage row after this write (negative: never written).
    row_ids = torch.arange(rows, device=k_store.device, dtype=torch.int64)
    row_pos = row_position(row_ids, pos[-1:], rows)
    allowed = (row_pos[None, :] <= pos[:, None]) & (row_pos[None, :] >= 0)
    if window is not None:
        allowed = allowed & (row_pos[None, :] > pos[:, None] - window)
    seen = allowed.any(dim=0)  # rows some query of this step reads

    keys = torch.where(seen[None, None, :, None], k_store, 0).float()
    values = torch.where(seen[None, None, :, None], v_store, 0).float()
    group = hq // hkv
    # Merging the group into the token dim is a view of the dense copy, whatever q's strides.
    qf = dense_copy(q, torch.float32).reshape(b, hkv, group * t, d)
    scores = soft_cap(torch.matmul(qf, keys.transpose(-1, -2)) * scale, softcap)
    scores = scores.reshape(b, hkv, group, t, rows)
    scores = torch.where(allowed, scores, float("-inf"))
    probs = attention_probs(scores, sinks).reshape(b, hkv, group * t, rows)
    out = torch.matmul(probs, values)
    return out.reshape(b, hq, t, v_store.shape[-1]).to(out_dtype)
