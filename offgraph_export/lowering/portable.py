"""Portable (aten-only) lowered step: write this step's K/V rows into storage in place, then
attend over the valid rows only. Serves the CPU and is the fallback on CUDA.

Storage is ``[B, Hkv, rows, D]``. Flat layers write row = position; ring layers write
row = position mod rows. Rows never written may hold anything (the check poisons them with NaN),
so invalid rows are removed from the scores with ``where`` (not an additive mask) and zeroed in V
before the weighted sum: ``0 * NaN`` would otherwise leak into every output.
"""

from __future__ import annotations

import torch

__all__ = ["portable_update_and_attend"]


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
) -> torch.Tensor:
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    rows = k_store.shape[2]
    pos = position.reshape(-1)
    write_rows = pos if window is None else torch.remainder(pos, rows)
    k_store.index_copy_(2, write_rows, k.to(k_store.dtype))
    v_store.index_copy_(2, write_rows, v.to(v_store.dtype))

    # Absolute position held by each storage row after this write (negative: never written).
    row_ids = torch.arange(rows, device=k_store.device, dtype=torch.int64)
    last = pos[-1:]
    row_pos = row_ids if window is None else last - torch.remainder(last - row_ids, rows)
    allowed = (row_pos[None, :] <= pos[:, None]) & (row_pos[None, :] >= 0)
    if window is not None:
        allowed = allowed & (row_pos[None, :] > pos[:, None] - window)
    seen = allowed.any(dim=0)  # rows some query of this step reads

    keys = torch.where(seen[None, None, :, None], k_store, 0).float()
    values = torch.where(seen[None, None, :, None], v_store, 0).float()
    group = hq // hkv
    qf = q.float().reshape(b, hkv, group * t, d)
    scores = torch.matmul(qf, keys.transpose(-1, -2)) * scale
    scores = scores.reshape(b, hkv, group, t, rows)
    scores = torch.where(allowed, scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(b, hkv, group * t, rows)
    out = torch.matmul(probs, values)
    return out.reshape(b, hq, t, v_store.shape[-1]).to(out_dtype)
