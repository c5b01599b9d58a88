"""The multi-token family of the Triton step's kernels (every step width the export keeps dynamic:
prefill, and any step of ``T`` tokens not known to be 1) and its launcher, :func:`prefill_step`.

Kernels, launched in this order on one stream:

1. ``_write_rows_kernel``: one program per (token, batch x kv head) copies the k and v rows (cast
   to the storage dtype) to the row of its position (``_storage_row``: position mod rows, the rule
   of :func:`offgraph_export.specs.manifest.storage_row`, for flat and ring alike).
2. ``_attend_kernel``: flash attention with an online softmax in fp32. A tile's query rows are
   (token, query head of the group) pairs of one kv head, so GQA/MQA reads each K/V row once per
   kv head, never materializing repeated heads. It loops only over the absolute positions its
   queries may see: ``[0, max_pos]`` clipped to the positions the storage still holds, and with a
   window (ring layers) to ``[min_pos - window + 1, max_pos]``. Those rows were all written, so
   poisoned (NaN) rows outside are never loaded.
3. ``_combine_splits_kernel``: the flash-decoding reduce, see below.

Choosing the split-K (flash-decoding) path
------------------------------------------
A decode step has one query tile per kv head, which would leave most of the GPU idle over a long
history. So the attention kernel is launched twice per step with grids that are complementary
integer expressions of ``T``: one of them is always empty (with a concrete ``T`` it is not
launched at all; with a symbolic one the grid evaluates to 0 at run time and the launcher skips it,
eagerly and in AOTInductor alike). No Python ``if`` on ``T``, which export would bake in.

* small steps (``T <= _small_t(group)``: a kv head's query rows fit one tile, e.g. decode) run
  the *split* variant: grid ``(tiles, B*Hkv, S)`` where ``S`` (static, from ``B*Hkv``) is how
  many programs may share one tile's key range. On the device each tile cuts its own valid key range
  into chunks of at least ``_MIN_SPLIT_KEYS`` keys, so a short history uses one split (which writes
  the output directly; the reduce then does nothing) and a long one uses up to ``S`` splits that
  write partial ``(max, sum, acc)`` rows which ``_combine_splits_kernel`` merges.
* larger steps (prefill) run the *tiled* variant with bigger query tiles and no split.

Both variants are complete implementations, so whichever one a compiler ends up keeping for a given
``T`` gives the right answer; the choice only affects speed.
"""

from __future__ import annotations

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
    _part_rows,
    _query_positions,
    _rows_if,
    _split_keys,
    _soft_capped,
    _split_plan,
    _storage_row,
    _store_split,
    _tile_key_range,
    _tile_rows,
    partial_buffers,
    split_count,
)
from offgraph_export.kernels.triton_base import pow2_at_least, tl, triton

__all__ = ["prefill_step"]

#: Programs the split variant aims for in total (about two per SM of an H100/H200).
_SPLIT_TARGET_PROGRAMS = 256
#: A split gets at least this many keys, so short histories are not cut into tiny pieces (each
#: split writes a partial row and costs a program).
_MIN_SPLIT_KEYS = 256
#: Query-tile height of the tiled (prefill) variant.
_TILED_BLOCK_M = 64
#: Keeps ``small`` in {0, 1} for any T below it: see :func:`_is_small_step`.
_BIG = 1 << 30


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _write_rows_kernel(
    k_ptr, v_ptr, pos_ptr, k_store_ptr, v_store_ptr,
    sk_b, sk_h, sk_t, sk_d,
    sv_b, sv_h, sv_t, sv_d,
    sks_b, sks_h, sks_r,
    svs_b, svs_h, svs_r,
    pos_stride, rows, n_kv_heads,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Program (t, b * Hkv + h): copy token t's k and v rows of kv head h into storage.

    The row comes from the position read here on the device. A position the storage cannot hold
    (:func:`_can_store`) is dropped rather than written over another position's row."""
    t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = _batch_and_head(pid_bh, n_kv_heads)
    pos = tl.load(pos_ptr + t * pos_stride)
    row = _storage_row(pos, rows)
    in_range = _can_store(pos, rows, HAS_WINDOW)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < tl.where(in_range, HEAD_DIM, 0)
    key = tl.load(k_ptr + b * sk_b + h * sk_h + t * sk_t + offs_d * sk_d, mask=d_ok, other=0.0)
    tl.store(
        k_store_ptr + b * sks_b + h * sks_h + row * sks_r + offs_d,
        key.to(k_store_ptr.dtype.element_ty),  # round to nearest even, as torch's .to()
        mask=d_ok,
    )
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < tl.where(in_range, V_DIM, 0)
    val = tl.load(v_ptr + b * sv_b + h * sv_h + t * sv_t + offs_dv * sv_d, mask=dv_ok, other=0.0)
    tl.store(
        v_store_ptr + b * svs_b + h * svs_h + row * svs_r + offs_dv,
        val.to(v_store_ptr.dtype.element_ty),
        mask=dv_ok,
    )


@triton.jit
def _attend_kernel(
    q_ptr, k_store_ptr, v_store_ptr, pos_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, sink_ptr,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_r,
    sv_b, sv_h, sv_r,
    so_b, so_h, so_t,
    pos_stride, T, rows, window, n_kv_heads, qk_scale, num_splits, cap_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PART_ROWS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Program (query tile, b * Hkv + kv head, split): online-softmax attention of the tile's
    queries over its valid keys (``SPLIT``: over this split's chunk of them). With ``SOFTCAP``
    each block of scores is capped before it is masked and enters the max; with ``HAS_SINKS``
    split 0 (the only one of the tiled variant) starts its rows from their heads' sinks.

    Scores are in the log2 domain (``qk_scale`` = scale * log2(e)) so ``exp2`` does the softmax.
    Scores a query may not see are set to -inf *before* the max, and K/V loads outside the range
    are masked to 0, so nothing outside the valid rows enters the sums. ``QK_FP32``/``PV_FP32``
    pick fp32 (IEEE, not TF32) dot products when the operands are fp32 or of mixed dtypes; 16-bit
    storage uses tensor cores with fp32 accumulation.

    Storage and output rows are contiguous (unit last-dim stride, written into the address
    arithmetic rather than passed): only then can the compiler vectorize and software-pipeline
    the K/V loads, whether or not the caller specializes strides equal to 1."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b, kvh = _batch_and_head(pid_bh, n_kv_heads)

    tok, grp, row_ok, offs_m = _tile_rows(T, pid_m, GROUP, BLOCK_M)
    qpos = _query_positions(pos_ptr, pos_stride, tok, row_ok)
    head = kvh * GROUP + grp
    lo, hi = _tile_key_range(pos_ptr, pos_stride, T, rows, window, qpos, row_ok, HAS_WINDOW)
    if SPLIT:
        k_lo, k_hi, n_used = _split_keys(lo, hi, split, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    else:
        k_lo = lo
        k_hi = hi

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_DIM
    q = tl.load(
        q_ptr + b * sq_b + head[:, None] * sq_h + tok[:, None] * sq_t + offs_d[None, :] * sq_d,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if QK_FP32:
        q = q.to(tl.float32)
    k_base = k_store_ptr + b * sk_b + kvh * sk_h
    v_base = v_store_ptr + b * sv_b + kvh * sv_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_SINKS:
        m_i, l_i, acc = _join_sinks(sink_ptr, head, _rows_if(offs_m, GROUP * T, split == 0), m_i, l_i, acc)
    for start in range(k_lo, k_hi, BLOCK_N):
        p_abs = start + tl.arange(0, BLOCK_N)
        key_ok = p_abs < k_hi
        key_row = _storage_row(p_abs, rows)
        s = _block_scores(q, k_base, key_row, key_ok, sk_r, offs_d, d_ok, qk_scale, QK_FP32)
        s = _soft_capped(s, cap_scale, SOFTCAP)
        seen = key_ok[None, :] & row_ok[:, None] & (p_abs[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            seen = seen & (p_abs[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_i, l_i, acc = _block_accumulate(
            s, v_base, key_row, key_ok, sv_r, offs_dv, dv_ok, m_i, l_i, acc, PV_FP32
        )

    out_tile = (
        out_ptr + b * so_b + head[:, None] * so_h + tok[:, None] * so_t + offs_dv[None, :]
    )
    result = _normalized(acc, l_i).to(out_ptr.dtype.element_ty)
    if SPLIT:
        part_row = _part_rows(pid_bh, num_splits, split, PART_ROWS, offs_m)
        _store_split(
            out_tile, result, part_acc_ptr, part_m_ptr, part_l_ptr, part_row, m_i, l_i, acc,
            offs_m, GROUP * T, offs_dv, dv_ok, split, n_used, BLOCK_DV,
        )
    else:
        tl.store(out_tile, result, mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def _combine_splits_kernel(
    pos_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    so_b, so_h, so_t,
    pos_stride, T, rows, window, n_kv_heads, num_splits,
    GROUP: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PART_ROWS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Program (query tile, b * Hkv + kv head): merge the tile's partial ``(max, sum, acc)`` rows
    into the output: ``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``, M the running max.

    It recomputes the attention kernel's split plan from the positions, so it knows how many
    partials exist; a tile that used a single split was already written and is left alone."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, kvh = _batch_and_head(pid_bh, n_kv_heads)
    tok, grp, row_ok, offs_m = _tile_rows(T, pid_m, GROUP, BLOCK_M)
    qpos = _query_positions(pos_ptr, pos_stride, tok, row_ok)
    head = kvh * GROUP + grp
    lo, hi = _tile_key_range(pos_ptr, pos_stride, T, rows, window, qpos, row_ok, HAS_WINDOW)
    chunk, n_used = _split_plan(lo, hi, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    n_merge = tl.where(n_used > 1, n_used, 0)

    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s in range(0, n_merge):
        part_row = _part_rows(pid_bh, num_splits, s, PART_ROWS, offs_m)
        m_s = tl.load(part_m_ptr + part_row, mask=row_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part_row, mask=row_ok, other=0.0)
        acc_s = tl.load(
            part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m_i, m_s)
        m_ref = _finite_max(m_new)
        alpha = tl.exp2(m_i - m_ref)
        beta = tl.exp2(m_s - m_ref)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new

    result = _normalized(acc, l_i).to(out_ptr.dtype.element_ty)
    out_tile = (
        out_ptr + b * so_b + head[:, None] * so_h + tok[:, None] * so_t + offs_dv[None, :]
    )
    merged = _rows_if(offs_m, GROUP * T, n_used > 1)
    tl.store(out_tile, result, mask=merged[:, None] & (offs_dv[None, :] < V_DIM))


# ---------------------------------------------------------------------------------------------
# Host side: shape arithmetic that works on ints and SymInts alike
# ---------------------------------------------------------------------------------------------


def _split_block_m(group: int) -> int:
    """Query-tile height of the split variant: two tokens of a whole GQA group (tensor-core dots
    need 16 rows; capped at 64 so very wide groups take several tiles).

    Two tokens, not one: export's dynamic token width starts at 2 (0/1 specialization), and a
    gate that only admits T == 1 could be folded to "never" from that range, silently sending
    decode to the tiled variant."""
    return min(64, pow2_at_least(2 * group))


def _small_t(group: int) -> int:
    """The largest step width the split variant serves: as many tokens as fit one tile."""
    return max(1, _split_block_m(group) // group)


def _is_small_step(t, small_t: int):
    """1 if ``t <= small_t`` else 0, for 1 <= t < ``_BIG``, using only floor division by a
    constant: an expression export and AOTInductor keep symbolic (no guard, no Max/Piecewise)."""
    return (small_t + _BIG - t) // _BIG


def _num_splits(b, hkv: int) -> int:
    """Splits per query tile for the split variant: enough that ``B * Hkv * splits`` fills the
    GPU (:data:`_SPLIT_TARGET_PROGRAMS` programs)."""
    return split_count(b, hkv, _SPLIT_TARGET_PROGRAMS, round_up=False)


def _statically_zero(n) -> bool:
    """True only for a concrete 0 (a SymInt grid is left to the launcher, which skips empty
    grids)."""
    return isinstance(n, int) and n == 0


def prefill_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    out: torch.Tensor,
    launch: AttendLaunch,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A step of ``T`` tokens (``T`` an int or a SymInt): the row writes, then the split variant
    and its combine for small steps and the tiled variant for larger ones, with complementary
    grids (see the module docstring). ``pos``: the positions, one per token; ``out``: the
    ``[B, Hq, T, Dv]`` output, written here and returned; ``sinks``: the ``[Hq]`` sink logits
    where ``launch.has_sinks``."""
    b, _, t, _ = q.shape
    hkv = k.shape[1]
    rows = k_store.shape[2]
    group = launch.group
    wrap_triton = torch.library.wrap_triton
    wrap_triton(_write_rows_kernel)[(t, b * hkv, 1)](
        k, v, pos, k_store, v_store,
        *k.stride(), *v.stride(), *k_store.stride()[:3], *v_store.stride()[:3],
        pos.stride(0), rows, hkv,
        HEAD_DIM=launch.head_dim, V_DIM=launch.v_dim, BLOCK_D=launch.block_d,
        BLOCK_DV=launch.block_dv, HAS_WINDOW=launch.has_window,
    )

    constexprs = {**launch.constexprs(), **launch.feature_constexprs(), "MIN_SPLIT_KEYS": _MIN_SPLIT_KEYS}
    sink = sinks  # None without HAS_SINKS: a constexpr None, never loaded (no alias of another argument)
    strides = (*q.stride(), *k_store.stride()[:3], *v_store.stride()[:3], *out.stride()[:3])
    scalars = (pos.stride(0), t, rows, launch.window, hkv, launch.qk_scale)

    small_t = _small_t(group)
    small = _is_small_step(t, small_t)
    large = 1 - small

    # Split variant (small steps): the tiles cover group * small_t query rows.
    split_m = _split_block_m(group)
    split_tiles = -(-(group * small_t) // split_m)
    splits = _num_splits(b, hkv)
    part_rows = split_tiles * split_m
    part_acc, part_m, part_l = partial_buffers(b * hkv, splits, part_rows, launch.block_dv, q.device)
    if not _statically_zero(small):
        wrap_triton(_attend_kernel)[(split_tiles * small, b * hkv, splits)](
            q, k_store, v_store, pos, out, part_acc, part_m, part_l, sink,
            *strides, *scalars, splits, launch.cap_scale,
            BLOCK_M=split_m, PART_ROWS=part_rows, SPLIT=True, **constexprs,
        )
        wrap_triton(_combine_splits_kernel)[(split_tiles * small, b * hkv, 1)](
            pos, out, part_acc, part_m, part_l,
            *out.stride()[:3], pos.stride(0), t, rows, launch.window, hkv, splits,
            GROUP=group, V_DIM=launch.v_dim, BLOCK_DV=launch.block_dv, BLOCK_M=split_m,
            BLOCK_N=launch.block_n, PART_ROWS=part_rows, MIN_SPLIT_KEYS=_MIN_SPLIT_KEYS,
            HAS_WINDOW=launch.has_window,
        )

    # Tiled variant (larger steps, e.g. prefill): one program per query tile, no split.
    tiled_tiles = (group * t + _TILED_BLOCK_M - 1) // _TILED_BLOCK_M
    if not _statically_zero(large):
        wrap_triton(_attend_kernel)[(tiled_tiles * large, b * hkv, 1)](
            q, k_store, v_store, pos, out, part_acc, part_m, part_l, sink,
            *strides, *scalars, 1, launch.cap_scale,
            BLOCK_M=_TILED_BLOCK_M, PART_ROWS=part_rows, SPLIT=False, **constexprs,
        )
    return out
