"""The one-token family of the Triton step's kernels and its launcher, :func:`decode_step`.

Where ``T`` is the constant 1 (the decode method is traced with it; an eager one-token call too),
the step takes two launches instead of the multi-token family's three
(:mod:`~offgraph_export.kernels.attend_prefill`): ``_decode_attend_kernel`` attends the group's
query heads over the stored positions ``[lo, p)`` split across programs sized to the SM count, adds
the new position from ``k``/``v`` directly (rounded to the storage dtype) in split 0, and split 0
also writes the new row, so no program waits for the write; ``_decode_combine_kernel`` then merges
the partial rows, all splits of a head loaded at once. With a single split in use the output is
written directly and the combine does nothing. With the step's rotary rows the kernel also rotates
the query and the new key (``passes/decode_rope.py``), so no separate rotary kernel runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Optional

import torch

from offgraph_export.kernels.attend_common import (
    AttendLaunch,
    _batch_and_head,
    _block_accumulate,
    _block_scores,
    _can_store,
    _finite_max,
    _join_sinks,
    _normalized,
    _oldest_key,
    _part_rows,
    _rotate_half,
    _rows_if,
    _soft_capped,
    _split_keys,
    _split_plan,
    _storage_row,
    _store_split,
    partial_buffers,
    split_count,
)
from offgraph_export.kernels.triton_base import pdl_flags, pow2_at_least, sm_count, tl, triton, wait_for_inputs

__all__ = ["decode_step"]

#: A one-token step's split gets at least this many keys: a program's loop over its keys is
#: short, so a short history still spreads over several programs.
_DECODE_MIN_SPLIT_KEYS = 128


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_attend_kernel(
    q_ptr, k_ptr, v_ptr, k_store_ptr, v_store_ptr, pos_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, cos_ptr, sin_ptr, sink_ptr,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_d,
    sv_b, sv_h, sv_d,
    sks_b, sks_h, sks_r,
    svs_b, svs_h, svs_r,
    so_b, so_h,
    rows, window, n_kv_heads, qk_scale, num_splits, cap_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr,
    ROPE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b * Hkv + kv head, split) of a one-token step: the row write and the attention of
    the ``GROUP`` query heads of one kv head in one launch. With ``ROPE`` the query and the new
    key arrive unrotated and are rotated here by the step's ``cos``/``sin`` rows
    (:func:`_rotate_half`), so no separate rotary kernel runs.

    The new token's key and value are taken from ``k``/``v`` (rounded to the storage dtype, as
    the stored row will be), not read back from storage, so no program waits for the write: the
    stored positions attended are ``[lo, p)``, ``p`` the step's position, cut into splits like
    the multi-token split variant (:func:`_split_plan`), and split 0 adds the new position and
    writes its row (dropped, as in the multi-token row write, when the storage cannot hold it:
    :func:`_can_store`). Row ``p mod rows`` is never among the rows read: a flat layer has not
    written it before and in a ring it holds position ``p - rows < lo``. (A flat position at or
    past ``rows``, which the runtime never passes, is attended from k/v but not stored.) One split
    in use writes the output; several leave partial ``(max, sum, acc)`` rows for
    :func:`_decode_combine_kernel`. With ``SOFTCAP`` every score, the new position's too, is capped
    before it enters the max; with ``HAS_SINKS`` split 0 also takes its heads' sinks
    (:func:`_join_sinks`). PDL: :func:`~offgraph_export.kernels.triton_base.wait_for_inputs` first
    (both kernels)."""
    wait_for_inputs(PDL)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b, kvh = _batch_and_head(pid_bh, n_kv_heads)
    pos = tl.load(pos_ptr).to(tl.int32)
    lo = _oldest_key(pos, pos, rows, window, HAS_WINDOW)
    k_lo, k_hi, n_used = _split_keys(lo, pos, split, num_splits, MIN_SPLIT_KEYS, BLOCK_N)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = kvh * GROUP + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_DIM
    q_base = q_ptr + b * sq_b + head[:, None] * sq_h
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_base + offs_d[None, :] * sq_d, mask=q_mask, other=0.0)
    if ROPE:
        cos = tl.load(cos_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        q = _rotate_half(q, q_base, offs_d[None, :], sq_d, q_mask, cos[None, :], sin[None, :], HEAD_DIM)
    if QK_FP32:
        q = q.to(tl.float32)
    k_base = k_store_ptr + b * sks_b + kvh * sks_h
    v_base = v_store_ptr + b * svs_b + kvh * svs_h

    # Split 0: the step's own position, from k/v as the storage will hold them, and its row write,
    # before the loop, so nothing waits for the loop to issue these loads (no measurable change in
    # the H200 step, benchmarks/README.md); the online softmax starts from the new position
    # (m = its score, sum = 1, acc = its value).
    first = split == 0
    k_row = k_ptr + b * sk_b + kvh * sk_h
    new_key = tl.load(k_row + offs_d * sk_d, mask=d_ok, other=0.0)
    if ROPE:
        new_key = _rotate_half(new_key, k_row, offs_d, sk_d, d_ok, cos, sin, HEAD_DIM)
    new_key = new_key.to(k_store_ptr.dtype.element_ty)
    new_val = tl.load(v_ptr + b * sv_b + kvh * sv_h + offs_dv * sv_d, mask=dv_ok, other=0.0)
    new_val = new_val.to(v_store_ptr.dtype.element_ty)
    in_range = _can_store(pos, rows, HAS_WINDOW)
    row = _storage_row(pos, rows)
    write = first & in_range
    tl.store(k_base + row * sks_r + offs_d, new_key, mask=offs_d < tl.where(write, HEAD_DIM, 0))
    tl.store(v_base + row * svs_r + offs_dv, new_val, mask=offs_dv < tl.where(write, V_DIM, 0))
    s_new = tl.sum(q.to(tl.float32) * new_key.to(tl.float32)[None, :], axis=1) * qk_scale
    s_new = _soft_capped(s_new.to(tl.float32), cap_scale, SOFTCAP)
    m_i = tl.where(row_ok & first, s_new, float("-inf"))
    l_i = tl.where(row_ok & first, 1.0, 0.0)
    acc = l_i[:, None] * new_val.to(tl.float32)[None, :]
    if HAS_SINKS:
        m_i, l_i, acc = _join_sinks(sink_ptr, head, _rows_if(offs_m, GROUP, first), m_i, l_i, acc)

    for start in range(k_lo, k_hi, BLOCK_N):
        p_abs = start + tl.arange(0, BLOCK_N)
        key_ok = p_abs < k_hi
        key_row = _storage_row(p_abs, rows)
        s = _block_scores(q, k_base, key_row, key_ok, sks_r, offs_d, d_ok, qk_scale, QK_FP32)
        s = _soft_capped(s, cap_scale, SOFTCAP)
        s = tl.where(key_ok[None, :] & row_ok[:, None], s, float("-inf"))
        m_i, l_i, acc = _block_accumulate(
            s, v_base, key_row, key_ok, svs_r, offs_dv, dv_ok, m_i, l_i, acc, PV_FP32
        )

    out_tile = out_ptr + b * so_b + head[:, None] * so_h + offs_dv[None, :]
    result = _normalized(acc, l_i).to(out_ptr.dtype.element_ty)
    part_row = _part_rows(pid_bh, num_splits, split, BLOCK_M, offs_m)
    _store_split(
        out_tile, result, part_acc_ptr, part_m_ptr, part_l_ptr, part_row, m_i, l_i, acc,
        offs_m, GROUP, offs_dv, dv_ok, split, n_used, BLOCK_DV,
    )


@triton.jit
def _decode_combine_kernel(
    pos_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    so_b, so_h,
    rows, window, n_kv_heads, num_splits,
    GROUP: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b * Hkv + kv head, query head in the group) of a one-token step: merge the head's
    partial rows, all splits loaded at once (one round trip to memory rather than a loop of
    dependent loads): ``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``. It recomputes the
    attention kernel's split plan; with a single split the output was already written."""
    wait_for_inputs(PDL)
    pid_bh = tl.program_id(0)
    g = tl.program_id(1)
    b, kvh = _batch_and_head(pid_bh, n_kv_heads)
    # Every split's slot is loaded at once with the position (in bounds, unwritten ones hold
    # garbage), and the plan's mask applied after: no load waits for the position.
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    part_row = _part_rows(pid_bh, num_splits, offs_s, BLOCK_M, g)
    slot = offs_s < num_splits
    pos = tl.load(pos_ptr).to(tl.int32)
    m_s = tl.load(part_m_ptr + part_row, mask=slot, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part_row, mask=slot, other=0.0)
    acc_s = tl.load(part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], mask=slot[:, None], other=0.0)
    lo = _oldest_key(pos, pos, rows, window, HAS_WINDOW)
    chunk, n_used = _split_plan(lo, pos, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    n_merge = tl.where(n_used > 1, n_used, 0)
    s_ok = offs_s < n_merge
    m_s = tl.where(s_ok, m_s, float("-inf"))
    l_s = tl.where(s_ok, l_s, 0.0)
    acc_s = tl.where(s_ok[:, None], acc_s, 0.0)
    m = tl.max(m_s, axis=0)
    m_ref = _finite_max(m)
    w = tl.exp2(m_s - m_ref)
    l = tl.sum(l_s * w, axis=0)
    acc = tl.sum(acc_s * w[:, None], axis=0)
    l_safe = tl.where(l > 0.0, l, 1.0)
    out = out_ptr + b * so_b + (kvh * GROUP + g) * so_h + offs_dv
    tl.store(out, (acc / l_safe).to(out_ptr.dtype.element_ty), mask=offs_dv < tl.where(n_used > 1, V_DIM, 0))


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _decode_splits(b, hkv: int, device: torch.device) -> int:
    """Splits of a one-token step: enough that ``B * Hkv * splits`` programs put two on every SM
    of ``device`` (its SM count read at trace time: :func:`~offgraph_export.kernels.triton_base.sm_count`,
    which counts 128 where there is no GPU)."""
    return split_count(b, hkv, 2 * sm_count(device), round_up=True)


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    out: torch.Tensor,
    launch: AttendLaunch,
    rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    overrides: Optional[Mapping[str, int]] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A one-token step in two launches (:func:`_decode_attend_kernel`, which also writes the
    row, then :func:`_decode_combine_kernel`); ``out`` (``[B, Hq, 1, Dv]``) is written and
    returned. ``rope``: ``(cos, sin)`` rows of the head dim to rotate the query and new key with,
    in the kernel. ``overrides`` replaces launch parameters (``splits``, ``min_split_keys``,
    ``BLOCK_N``, ``num_warps``, ``num_stages``) for ``scripts/sweep_decode_kernels.py``, which
    calls this eagerly, and ``pdl``, ``pdl_trigger`` (:func:`~offgraph_export.kernels.triton_base.pdl_flags`;
    ``scripts/bench_pdl.py``). ``sinks``: the ``[Hq]`` sink logits where ``launch.has_sinks``."""
    overrides = overrides or {}
    b = q.shape[0]
    hkv = k.shape[1]
    group = launch.group
    block_m = pow2_at_least(group)
    splits = overrides.get("splits") or _decode_splits(b, hkv, q.device)
    min_split_keys = overrides.get("min_split_keys", _DECODE_MIN_SPLIT_KEYS)
    launch = replace(launch, block_n=overrides.get("BLOCK_N", launch.block_n))
    tuning = {key: overrides[key] for key in ("num_warps", "num_stages") if key in overrides}
    pdl = pdl_flags(overrides.get("pdl", False), overrides.get("pdl_trigger", "entry"))
    rows = k_store.shape[2]
    part_acc, part_m, part_l = partial_buffers(b * hkv, splits, block_m, launch.block_dv, q.device)
    wrap_triton = torch.library.wrap_triton
    cos, sin = rope if rope is not None else (pos, pos)  # unread without ROPE
    sink = sinks  # None without HAS_SINKS: a constexpr None, never loaded (no alias of another argument)
    wrap_triton(_decode_attend_kernel)[(b * hkv, splits, 1)](
        q, k, v, k_store, v_store, pos, out, part_acc, part_m, part_l, cos, sin, sink,
        q.stride(0), q.stride(1), q.stride(3),
        k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3),
        *k_store.stride()[:3], *v_store.stride()[:3], out.stride(0), out.stride(1),
        rows, launch.window, hkv, launch.qk_scale, splits, launch.cap_scale,
        BLOCK_M=block_m, MIN_SPLIT_KEYS=min_split_keys, ROPE=rope is not None,
        **launch.constexprs(), **launch.feature_constexprs(), **tuning, **pdl,
    )
    wrap_triton(_decode_combine_kernel)[(b * hkv, group, 1)](
        pos, out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
        rows, launch.window, hkv, splits,
        GROUP=group, V_DIM=launch.v_dim, BLOCK_DV=launch.block_dv, BLOCK_M=block_m,
        BLOCK_N=launch.block_n, BLOCK_S=pow2_at_least(splits, floor=2),
        MIN_SPLIT_KEYS=min_split_keys, HAS_WINDOW=launch.has_window, **pdl,
    )
    return out
