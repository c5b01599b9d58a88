"""Portable (aten-only) batched step over paged storage (design section 10): write every token's
K/V row, then attend each token over its own session's rows only.

Serves the CPU and is the Triton paged kernels' reference. A flat layer's storage is a page pool
``[pages, page_size, Hkv, D]``; token ``t`` reads the ``pages_per_session * page_size`` rows its
slot's page table names (``specs.manifest.paged_row``) and masks those past its position. A ring
layer's storage is one ring per slot ``[slots, Hkv, rows, D]``, its rows' positions from
``row_position`` at the slot's newest position (``session_lengths - 1``). Cost grows with the
tokens times the rows a session may hold, not with the live history: this is the reference, the
Triton kernels read only the valid rows. Rows never written may hold anything (NaN in the check),
so invalid rows are zeroed before the matmuls and removed from the scores with ``where``.
"""

from __future__ import annotations

import torch

from offgraph_export.specs.manifest import paged_row, row_position, storage_row

__all__ = ["portable_paged_update_and_attend"]


def _write_and_gather(
    new: torch.Tensor, store: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
    token_rows: torch.Tensor, page_table: torch.Tensor, window: int | None,
) -> torch.Tensor:
    """Write ``new`` ``[T, Hkv, D]`` into ``store`` in place and return each token's rows
    ``[T, L, Hkv, D]`` (flat: its session's pages in position order; ring: its slot's ring)."""
    if window is None:
        pages, page_size, hkv, d = store.shape
        pool = store.view(pages * page_size, hkv, d)
        pool.index_copy_(0, token_rows.long(), new.to(store.dtype))
        span = page_table.shape[1] * page_size
        j = torch.arange(span, device=store.device, dtype=torch.int64)
        rows = paged_row(page_table.long()[slots], j.expand(slots.shape[0], span), page_size)  # [T, L]
        return pool[rows]
    _, hkv, ring, d = store.shape
    heads = torch.arange(hkv, device=store.device, dtype=torch.int64)
    store.index_put_((slots[:, None], heads[None, :], storage_row(pos, ring)[:, None]), new.to(store.dtype))
    return store[slots].transpose(1, 2)


def portable_paged_update_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    token_slots: torch.Tensor,
    token_rows: torch.Tensor,
    page_table: torch.Tensor,
    session_lengths: torch.Tensor,
    window: int | None,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``q`` ``[1, Hq, T, D]``, ``k``/``v`` ``[1, Hkv, T, D|Dv]``, ``position`` ``[T]`` or
    ``[T, 1]`` (each token's position in its own session); the batch inputs as in design
    section 10. Returns ``[1, Hq, T, Dv]`` in ``out_dtype``."""
    _, hq, t, d = q.shape
    hkv = k.shape[1]
    pos = position.reshape(-1)
    slots = token_slots.long()
    keys = _write_and_gather(k[0].transpose(0, 1), k_store, slots, pos, token_rows, page_table, window)
    values = _write_and_gather(v[0].transpose(0, 1), v_store, slots, pos, token_rows, page_table, window)
    span = keys.shape[1]
    j = torch.arange(span, device=q.device, dtype=torch.int64)[None, :]
    if window is None:
        held = j.expand(t, span)  # the flat rows are gathered in position order
    else:
        last = session_lengths.long()[slots][:, None] - 1
        held = row_position(j, last, span)
    allowed = (held >= 0) & (held <= pos[:, None])
    if window is not None:
        allowed = allowed & (held > pos[:, None] - window)
    keys = torch.where(allowed[:, :, None, None], keys, 0).float()  # [T, L, Hkv, D]
    values = torch.where(allowed[:, :, None, None], values, 0).float()
    group = hq // hkv
    qf = q[0].float().transpose(0, 1).reshape(t, hkv, group, d)  # [T, Hkv, G, D]
    scores = torch.einsum("thgd,tlhd->thgl", qf, keys) * scale
    scores = torch.where(allowed[:, None, None, :], scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgl,tlhd->thgd", probs, values)  # [T, Hkv, G, Dv]
    return out.reshape(t, hq, -1).transpose(0, 1).unsqueeze(0).to(out_dtype)
