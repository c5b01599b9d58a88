"""Triton lowered step for CUDA: write this step's K/V rows into storage in place, then attend over
the valid rows only, reading nothing beyond them.

Same contract as :func:`offgraph_export.lowering.portable.portable_update_and_attend` (the
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
* Kernels, launched in this order on one stream:

  1. ``_write_rows_kernel``: one program per (token, batch x kv head) copies the k and v rows
     (cast to the storage dtype) to the row of its position (``_storage_row``: position mod rows,
     the rule of :func:`offgraph_export.specs.manifest.storage_row`, for flat and ring alike).
  2. ``_attend_kernel``: flash attention with an online softmax in fp32. A tile's query rows are
     (token, query head of the group) pairs of one kv head, so GQA/MQA reads each K/V row once per
     kv head, never materializing repeated heads. It loops only over the absolute positions its
     queries may see: ``[0, max_pos]`` clipped to the positions the storage still holds, and with a
     window (ring layers) to ``[min_pos - window + 1, max_pos]``.
     Those rows were all written, so poisoned (NaN) rows outside are never loaded.
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

One-token steps (the decode method)
-----------------------------------
Where ``T`` is the constant 1 (the decode method is traced with it; an eager one-token call too),
the step takes two launches instead of three: ``_decode_attend_kernel`` attends the group's query
heads over the stored positions ``[lo, p)`` split across programs sized to the SM count, adds the
new position from ``k``/``v`` directly (rounded to the storage dtype) in split 0, and split 0 also
writes the new row, so no program waits for the write; ``_decode_combine_kernel`` then merges the
partial rows, all splits of a head loaded at once. With a single split in use the output is
written directly and the combine does nothing.
"""

import math
from typing import Optional

import torch

from offgraph_export.errors import ExportError
from offgraph_export.lowering.triton_base import (
    INTERPRETED as _INTERPRETED,
    TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR,
    pow2_at_least as _pow2_at_least,
    sm_count,
    tl,
    triton,
)

__all__ = ["triton_update_and_attend", "OP_NAME"]

OP_NAME = "offgraph_lowered::triton_update_and_attend"


# ---------------------------------------------------------------------------------------------
# Tuning constants (host side; the kernels receive them as arguments or constexprs).
# ---------------------------------------------------------------------------------------------

#: Programs the split variant aims for in total (about two per SM of an H100/H200).
_SPLIT_TARGET_PROGRAMS = 256
#: Upper bound on splits per query tile; also sizes the partial-result buffers.
_MAX_SPLITS = 64
#: A split gets at least this many keys, so short histories are not cut into tiny pieces (each
#: split writes a partial row and costs a program).
_MIN_SPLIT_KEYS = 256
#: The same for a one-token step (:func:`_decode_attend_kernel`): a program's loop over its keys
#: is short, so a short history still spreads over several programs.
_DECODE_MIN_SPLIT_KEYS = 128
#: Query-tile height of the tiled (prefill) variant.
_TILED_BLOCK_M = 64
#: Keeps ``small`` in {0, 1} for any T below it: see :func:`_is_small_step`.
_BIG = 1 << 30


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _storage_row(position, rows):
    """The storage row of an absolute position: :func:`offgraph_export.specs.manifest.storage_row`
    (``position mod rows``), restated here because jit code cannot call host Python. Positions are
    non-negative, where Triton's truncating ``%`` and Python's floor ``%`` agree."""
    return position % rows


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
    (negative, or past a flat layer's rows: a flat layer never wraps), which the runtime never
    passes, is dropped rather than written over another position's row."""
    t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    pos = tl.load(pos_ptr + t * pos_stride)
    row = _storage_row(pos, rows)
    in_range = (pos >= 0) & ((pos < rows) | HAS_WINDOW)

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
def _rows_if(offs_m, n_rows, cond):
    """``offs_m < n_rows`` where the scalar ``cond`` holds, else all false.

    Written as one comparison rather than ``(offs_m < n_rows) & cond``: the Triton interpreter
    (used by the CPU tests) turns a block ``&`` a scalar bool into an int mask it then rejects."""
    return offs_m < tl.where(cond, n_rows, 0)


@triton.jit
def _tile_queries(pos_ptr, pos_stride, T, pid_m, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query rows of tile ``pid_m``: row m is token ``m // GROUP`` of query head
    ``m % GROUP`` within the kv head's group. Returns (token, head-in-group, row is real, the
    row's absolute position as int32, the row indices)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP * T
    tok = offs_m // GROUP
    grp = offs_m % GROUP
    qpos = tl.load(pos_ptr + tok * pos_stride, mask=row_ok, other=0).to(tl.int32)
    return tok, grp, row_ok, qpos, offs_m


@triton.jit
def _tile_key_range(pos_ptr, pos_stride, T, rows, window, qpos, row_ok, HAS_WINDOW: tl.constexpr):
    """Absolute positions ``[lo, hi)`` some query of the tile may attend to, as int32 scalars.

    ``(.., max_pos]``, clipped to positions >= 0 (written at all) and to the ``rows`` newest
    positions (the ones the storage still holds after this step's writes, whose last position is
    ``position[T-1]``; for a flat layer that is every position, since it never wraps), and with a
    window (ring layers) to ``(min_pos - window, ..``. Every position in the range is held by its
    row, so loops over it never read a row that was not written. An empty tile gets ``hi <= lo``."""
    hi = tl.max(tl.where(row_ok, qpos, -1), axis=0) + 1
    last = tl.load(pos_ptr + (T - 1) * pos_stride).to(tl.int32)
    lo = tl.maximum(last - rows + 1, 0)
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.min(tl.where(row_ok, qpos, 1 << 30), axis=0) - window + 1)
    return lo, hi


@triton.jit
def _split_plan(lo, hi, num_splits, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """How a tile's key range is cut for the split variant: (keys per split, splits used).

    Chunks hold at least ``MIN_SPLIT_KEYS`` keys and a whole number of ``BLOCK_N`` blocks, so a
    short range uses a single split. Both the attention and the combine kernel call this with the
    same arguments, so they agree on the plan without talking to each other."""
    n_keys = tl.maximum(hi - lo, 0)
    chunk = (n_keys + num_splits - 1) // num_splits
    chunk = tl.maximum(chunk, MIN_SPLIT_KEYS)
    chunk = ((chunk + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    n_used = tl.maximum((n_keys + chunk - 1) // chunk, 1)
    return chunk, n_used


@triton.jit
def _block_scores(q, k_base, key_row, key_ok, sk_r, offs_d, d_ok, qk_scale, QK_FP32: tl.constexpr):
    """Scores (log2 domain, fp32) of the query tile against one block of stored keys, loaded
    already transposed (``[BLOCK_D, BLOCK_N]``); keys outside ``key_ok`` load as 0 (the caller
    masks their scores)."""
    k = tl.load(
        k_base + key_row[None, :] * sk_r + offs_d[:, None],
        mask=key_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    if QK_FP32:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    # Inductor may hand a Python float argument to the kernel as fp64: keep the scores fp32 so
    # the loop-carried softmax state keeps one type.
    return (s * qk_scale).to(tl.float32)


@triton.jit
def _block_accumulate(s, v_base, key_row, key_ok, sv_r, offs_dv, dv_ok, m_i, l_i, acc, PV_FP32: tl.constexpr):
    """One online-softmax step over a block of masked scores ``s`` (-inf where unseen) and the
    block's stored values: returns the new ``(max, sum, acc)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing seen yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_base + key_row[:, None] * sv_r + offs_dv[None, :],
        mask=key_ok[:, None] & dv_ok[None, :],
        other=0.0,
    )
    if PV_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_kernel(
    q_ptr, k_store_ptr, v_store_ptr, pos_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_r,
    sv_b, sv_h, sv_r,
    so_b, so_h, so_t,
    pos_stride, T, rows, window, n_kv_heads, qk_scale, num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PART_ROWS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr,
):
    """Program (query tile, b * Hkv + kv head, split): online-softmax attention of the tile's
    queries over its valid keys (``SPLIT``: over this split's chunk of them).

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
    b = (pid_bh // n_kv_heads).to(tl.int64)
    kvh = (pid_bh % n_kv_heads).to(tl.int64)

    tok, grp, row_ok, qpos, offs_m = _tile_queries(pos_ptr, pos_stride, T, pid_m, GROUP, BLOCK_M)
    head = kvh * GROUP + grp
    lo, hi = _tile_key_range(pos_ptr, pos_stride, T, rows, window, qpos, row_ok, HAS_WINDOW)
    if SPLIT:
        chunk, n_used = _split_plan(lo, hi, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
        k_lo = lo + split * chunk
        k_hi = tl.minimum(k_lo + chunk, hi)
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
    for start in range(k_lo, k_hi, BLOCK_N):
        p_abs = start + tl.arange(0, BLOCK_N)
        key_ok = p_abs < k_hi
        key_row = _storage_row(p_abs, rows)
        s = _block_scores(q, k_base, key_row, key_ok, sk_r, offs_d, d_ok, qk_scale, QK_FP32)
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
    out_mask = row_ok[:, None] & dv_ok[None, :]
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty)
    if SPLIT:
        # One split in use: it holds the whole answer, and the combine kernel will skip this tile.
        direct = _rows_if(offs_m, GROUP * T, (n_used == 1) & (split == 0))
        tl.store(out_tile, result, mask=direct[:, None] & dv_ok[None, :])
        # Several: leave the unnormalized partial for the combine kernel.
        part_row = (pid_bh.to(tl.int64) * num_splits + split) * PART_ROWS + pid_m * BLOCK_M
        part_row = part_row + tl.arange(0, BLOCK_M)
        keep = _rows_if(offs_m, GROUP * T, (n_used > 1) & (split < n_used))
        tl.store(part_m_ptr + part_row, m_i, mask=keep)
        tl.store(part_l_ptr + part_row, l_i, mask=keep)
        tl.store(
            part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], acc,
            mask=keep[:, None],
        )
    else:
        tl.store(out_tile, result, mask=out_mask)


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
    b = (pid_bh // n_kv_heads).to(tl.int64)
    kvh = (pid_bh % n_kv_heads).to(tl.int64)
    tok, grp, row_ok, qpos, offs_m = _tile_queries(pos_ptr, pos_stride, T, pid_m, GROUP, BLOCK_M)
    head = kvh * GROUP + grp
    lo, hi = _tile_key_range(pos_ptr, pos_stride, T, rows, window, qpos, row_ok, HAS_WINDOW)
    chunk, n_used = _split_plan(lo, hi, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    n_merge = tl.where(n_used > 1, n_used, 0)

    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for s in range(0, n_merge):
        part_row = (pid_bh.to(tl.int64) * num_splits + s) * PART_ROWS + pid_m * BLOCK_M
        part_row = part_row + tl.arange(0, BLOCK_M)
        m_s = tl.load(part_m_ptr + part_row, mask=row_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part_row, mask=row_ok, other=0.0)
        acc_s = tl.load(
            part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m_i, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        beta = tl.exp2(m_s - m_ref)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty)
    out_tile = (
        out_ptr + b * so_b + head[:, None] * so_h + tok[:, None] * so_t + offs_dv[None, :]
    )
    merged = _rows_if(offs_m, GROUP * T, n_used > 1)
    tl.store(out_tile, result, mask=merged[:, None] & (offs_dv[None, :] < V_DIM))


@triton.jit
def _rotate_half(x, base, offs, stride, mask, cos, sin, HEAD_DIM: tl.constexpr):
    """Rotary embedding of the tile ``x`` (head dim last, loaded from ``base + offs * stride``):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed in fp32
    and rounded once to ``x``'s dtype, as Inductor's fused rotary kernel does (eager rounds each
    product and the sum: in bf16 the two can differ by one unit in the last place)."""
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    other = tl.load(base + partner * stride, mask=mask, other=0.0).to(tl.float32)
    other = tl.where(offs < half, -other, other)
    return (x.to(tl.float32) * cos + other * sin).to(x.dtype)


@triton.jit
def _decode_attend_kernel(
    q_ptr, k_ptr, v_ptr, k_store_ptr, v_store_ptr, pos_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, cos_ptr, sin_ptr,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_d,
    sv_b, sv_h, sv_d,
    sks_b, sks_h, sks_r,
    svs_b, svs_h, svs_r,
    so_b, so_h,
    rows, window, n_kv_heads, qk_scale, num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Program (b * Hkv + kv head, split) of a one-token step: the row write and the attention of
    the ``GROUP`` query heads of one kv head in one launch. With ``ROPE`` the query and the new
    key arrive unrotated and are rotated here by the step's ``cos``/``sin`` rows
    (:func:`_rotate_half`), so no separate rotary kernel runs.

    The new token's key and value are taken from ``k``/``v`` (rounded to the storage dtype, as
    the stored row will be), not read back from storage, so no program waits for the write: the
    stored positions attended are ``[lo, p)``, ``p`` the step's position, cut into splits like
    the multi-token split variant (:func:`_split_plan`), and split 0 adds the new position and
    writes its row (dropped, as in :func:`_write_rows_kernel`, when the storage cannot hold it).
    Row ``p mod rows`` is never among the rows read: a flat layer has not written it before and
    in a ring it holds position ``p - rows < lo``. (A flat position at or past ``rows``, which the
    runtime never passes, is attended from k/v but not stored.) One split in use writes the output; several
    leave partial ``(max, sum, acc)`` rows for :func:`_decode_combine_kernel`."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    kvh = (pid_bh % n_kv_heads).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int32)
    lo = tl.maximum(pos - rows + 1, 0)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    chunk, n_used = _split_plan(lo, pos, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    k_lo = lo + split * chunk
    k_hi = tl.minimum(k_lo + chunk, pos)

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
    in_range = (pos >= 0) & ((pos < rows) | HAS_WINDOW)
    row = _storage_row(pos, rows)
    write = first & in_range
    tl.store(k_base + row * sks_r + offs_d, new_key, mask=offs_d < tl.where(write, HEAD_DIM, 0))
    tl.store(v_base + row * svs_r + offs_dv, new_val, mask=offs_dv < tl.where(write, V_DIM, 0))
    s_new = tl.sum(q.to(tl.float32) * new_key.to(tl.float32)[None, :], axis=1) * qk_scale
    m_i = tl.where(row_ok & first, s_new.to(tl.float32), float("-inf"))
    l_i = tl.where(row_ok & first, 1.0, 0.0)
    acc = l_i[:, None] * new_val.to(tl.float32)[None, :]

    for start in range(k_lo, k_hi, BLOCK_N):
        p_abs = start + tl.arange(0, BLOCK_N)
        key_ok = p_abs < k_hi
        key_row = _storage_row(p_abs, rows)
        s = _block_scores(q, k_base, key_row, key_ok, sks_r, offs_d, d_ok, qk_scale, QK_FP32)
        s = tl.where(key_ok[None, :] & row_ok[:, None], s, float("-inf"))
        m_i, l_i, acc = _block_accumulate(
            s, v_base, key_row, key_ok, svs_r, offs_dv, dv_ok, m_i, l_i, acc, PV_FP32
        )

    out_tile = out_ptr + b * so_b + head[:, None] * so_h + offs_dv[None, :]
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty)
    direct = _rows_if(offs_m, GROUP, (n_used == 1) & first)
    tl.store(out_tile, result, mask=direct[:, None] & dv_ok[None, :])
    part_row = (pid_bh.to(tl.int64) * num_splits + split) * BLOCK_M + offs_m
    keep = _rows_if(offs_m, GROUP, (n_used > 1) & (split < n_used))
    tl.store(part_m_ptr + part_row, m_i, mask=keep)
    tl.store(part_l_ptr + part_row, l_i, mask=keep)
    tl.store(part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=keep[:, None])


@triton.jit
def _decode_combine_kernel(
    pos_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    so_b, so_h,
    rows, window, n_kv_heads, num_splits,
    GROUP: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Program (b * Hkv + kv head, query head in the group) of a one-token step: merge the head's
    partial rows, all splits loaded at once (one round trip to memory rather than a loop of
    dependent loads): ``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``. It recomputes the
    attention kernel's split plan; with a single split the output was already written."""
    pid_bh = tl.program_id(0)
    g = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    kvh = (pid_bh % n_kv_heads).to(tl.int64)
    # Every split's slot is loaded at once with the position (in bounds, unwritten ones hold
    # garbage), and the plan's mask applied after: no load waits for the position.
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    part_row = (pid_bh.to(tl.int64) * num_splits + offs_s) * BLOCK_M + g
    slot = offs_s < num_splits
    pos = tl.load(pos_ptr).to(tl.int32)
    m_s = tl.load(part_m_ptr + part_row, mask=slot, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part_row, mask=slot, other=0.0)
    acc_s = tl.load(part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], mask=slot[:, None], other=0.0)
    lo = tl.maximum(pos - rows + 1, 0)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos - window + 1)
    chunk, n_used = _split_plan(lo, pos, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    n_merge = tl.where(n_used > 1, n_used, 0)
    s_ok = offs_s < n_merge
    m_s = tl.where(s_ok, m_s, float("-inf"))
    l_s = tl.where(s_ok, l_s, 0.0)
    acc_s = tl.where(s_ok[:, None], acc_s, 0.0)
    m = tl.max(m_s, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_s - m_ref)
    l = tl.sum(l_s * w, axis=0)
    acc = tl.sum(acc_s * w[:, None], axis=0)
    l_safe = tl.where(l > 0.0, l, 1.0)
    out = out_ptr + b * so_b + (kvh * GROUP + g) * so_h + offs_dv
    tl.store(out, (acc / l_safe).to(out_ptr.dtype.element_ty), mask=offs_dv < tl.where(n_used > 1, V_DIM, 0))


# ---------------------------------------------------------------------------------------------
# Host side: shape arithmetic that works on ints and SymInts alike
# ---------------------------------------------------------------------------------------------


def _split_block_m(group: int) -> int:
    """Query-tile height of the split variant: two tokens of a whole GQA group (tensor-core dots
    need 16 rows; capped at 64 so very wide groups take several tiles).

    Two tokens, not one: export's dynamic token width starts at 2 (0/1 specialization), and a
    gate that only admits T == 1 could be folded to "never" from that range, silently sending
    decode to the tiled variant."""
    return min(64, _pow2_at_least(2 * group))


def _small_t(group: int) -> int:
    """The largest step width the split variant serves: as many tokens as fit one tile."""
    return max(1, _split_block_m(group) // group)


def _is_small_step(t, small_t: int):
    """1 if ``t <= small_t`` else 0, for 1 <= t < ``_BIG``, using only floor division by a
    constant: an expression export and AOTInductor keep symbolic (no guard, no Max/Piecewise)."""
    return (small_t + _BIG - t) // _BIG


def _num_splits(b, hkv: int) -> int:
    """Splits per query tile for the split variant (static: it sizes the partial buffers). Enough
    that ``B * Hkv * splits`` fills the GPU; a symbolic batch gets a middle value."""
    heads = b * hkv
    if not isinstance(heads, int):
        return 16
    return max(1, min(_MAX_SPLITS, _SPLIT_TARGET_PROGRAMS // max(1, heads)))


def _decode_splits(b, hkv: int, device: torch.device) -> int:
    """Splits of a one-token step: enough that ``B * Hkv * splits`` programs put two on every SM
    of ``device`` (its SM count read at trace time; :data:`_SPLIT_TARGET_PROGRAMS` elsewhere)."""
    heads = b * hkv
    if not isinstance(heads, int):
        return 16
    target = 2 * sm_count(device)
    return max(1, min(_MAX_SPLITS, -(-target // max(1, heads))))


def _decode_step(q, k, v, pos, k_store, v_store, window, scale, out_dtype, out, common, rope=None,
                 config: Optional[dict] = None) -> torch.Tensor:
    """A one-token step in two launches (:func:`_decode_attend_kernel`, which also writes the
    row, then :func:`_decode_combine_kernel`). ``rope``: ``(cos, sin)`` rows of the head dim to
    rotate the query and new key with, in the kernel. ``config`` overrides launch parameters
    (``splits``, ``min_split_keys``, ``BLOCK_N``, ``num_warps``, ``num_stages``) for
    ``scripts/sweep_decode_kernels.py``, which calls this eagerly."""
    config = config or {}
    b, hq, _, _ = q.shape
    hkv = k.shape[1]
    group = int(hq // hkv)
    block_m = _pow2_at_least(group)
    splits = config.get("splits") or _decode_splits(b, hkv, q.device)
    min_split_keys = config.get("min_split_keys", _DECODE_MIN_SPLIT_KEYS)
    common = {**common, "BLOCK_N": config.get("BLOCK_N", common["BLOCK_N"])}
    launch = {key: config[key] for key in ("num_warps", "num_stages") if key in config}
    block_dv = common["BLOCK_DV"]
    rows = k_store.shape[2]
    window_arg = window if window is not None else 0
    part_acc = torch.empty((b * hkv, splits, block_m, block_dv), dtype=torch.float32, device=q.device)
    part_m = torch.empty((b * hkv, splits, block_m), dtype=torch.float32, device=q.device)
    part_l = torch.empty((b * hkv, splits, block_m), dtype=torch.float32, device=q.device)
    qk_scale = float(scale) * math.log2(math.e)
    wrap_triton = torch.library.wrap_triton
    cos, sin = rope if rope is not None else (pos, pos)  # unread without ROPE
    wrap_triton(_decode_attend_kernel)[(b * hkv, splits, 1)](
        q, k, v, k_store, v_store, pos, out, part_acc, part_m, part_l, cos, sin,
        q.stride(0), q.stride(1), q.stride(3),
        k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3),
        *k_store.stride()[:3], *v_store.stride()[:3], out.stride(0), out.stride(1),
        rows, window_arg, hkv, qk_scale, splits,
        BLOCK_M=block_m, MIN_SPLIT_KEYS=min_split_keys, ROPE=rope is not None, **common, **launch,
    )
    wrap_triton(_decode_combine_kernel)[(b * hkv, group, 1)](
        pos, out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
        rows, window_arg, hkv, splits,
        GROUP=group, V_DIM=common["V_DIM"], BLOCK_DV=block_dv, BLOCK_M=block_m,
        BLOCK_N=common["BLOCK_N"], BLOCK_S=_pow2_at_least(splits, floor=2),
        MIN_SPLIT_KEYS=min_split_keys, HAS_WINDOW=common["HAS_WINDOW"],
    )
    return out


def _statically_zero(n) -> bool:
    """True only for a concrete 0 (a SymInt grid is left to the launcher, which skips empty
    grids)."""
    return isinstance(n, int) and n == 0


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
) -> torch.Tensor:
    """Body of the triton_op (``window`` None: a flat layer). ``rope_cos``/``rope_sin``: the
    step's rotary rows (one position, ``D`` values each, q's dtype); q and k then arrive
    unrotated and a one-token step rotates them in its kernel (``passes/decode_rope.py``)."""
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    rows = k_store.shape[2]
    # Head dims and the group size are compile-time constants of the kernels (constexprs), so
    # they must be plain ints; in export they are static anyway (int() on a SymInt would guard).
    d, dv = int(q.shape[-1]), int(v.shape[-1])
    torch._check(hq % hkv == 0, lambda: f"Hq={hq} must be a multiple of Hkv={hkv}")
    torch._check(k.shape[2] == t, lambda: "k must have as many tokens as q")
    torch._check(v.shape[2] == t, lambda: "v must have as many tokens as q")
    torch._check(v_store.shape[2] == rows, lambda: "k_store and v_store must have equal rows")
    torch._check(
        k_store.stride(-1) == 1 and v_store.stride(-1) == 1,
        lambda: "storage rows must be contiguous (last-dim stride 1)",
    )
    group = int(hq // hkv)
    pos = position.reshape(-1)
    torch._check(pos.shape[0] == t, lambda: "position must hold one entry per token")
    has_window = window is not None
    window_arg = window if has_window else 0  # a kernel argument is an int; unread without a window
    block_d = _pow2_at_least(d)
    block_dv = _pow2_at_least(dv)
    out = torch.empty((b, hq, t, dv), dtype=out_dtype, device=q.device)

    sixteen_bit = (torch.float16,) if _INTERPRETED else (torch.float16, torch.bfloat16)
    qk_fp32 = not (q.dtype == k_store.dtype and k_store.dtype in sixteen_bit)
    pv_fp32 = v_store.dtype not in sixteen_bit
    # Key block: 64 rows while a K/V tile row is <= 256 bytes (bf16 x 128), else 32, so the
    # pipelined K and V tiles stay well inside shared memory (fp32 x 128, 16-bit x 256).
    row_bytes = max(block_d, block_dv) * k_store.element_size()
    block_n = 64 if row_bytes <= 256 else 32
    common = dict(
        GROUP=group, HEAD_DIM=d, V_DIM=dv, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_N=block_n,
        HAS_WINDOW=has_window, QK_FP32=qk_fp32, PV_FP32=pv_fp32,
    )
    rope = None
    if rope_cos is not None or rope_sin is not None:
        torch._check(rope_cos is not None and rope_sin is not None, lambda: "rotary rows come as cos and sin")
        torch._check(isinstance(t, int) and t == 1, lambda: "rotary rows are taken by one-token steps only")
        torch._check(d % 2 == 0 and k.shape[-1] == d, lambda: "rotary rows need an even head dim shared by q and k")
        torch._check(rope_cos.numel() == d and rope_sin.numel() == d, lambda: f"rotary rows must hold {d} values")
        torch._check(rope_cos.dtype == q.dtype == k.dtype == rope_sin.dtype, lambda: "rotary rows, q and k share a dtype")
        rope = (rope_cos.reshape(d).contiguous(), rope_sin.reshape(d).contiguous())
    if isinstance(t, int) and t == 1:
        # A concrete one-token step (the decode method, or an eager call): its own kernels.
        return _decode_step(q, k, v, pos, k_store, v_store, window, scale, out_dtype, out, common, rope)

    wrap_triton = torch.library.wrap_triton
    wrap_triton(_write_rows_kernel)[(t, b * hkv, 1)](
        k, v, pos, k_store, v_store,
        *k.stride(), *v.stride(), *k_store.stride()[:3], *v_store.stride()[:3],
        pos.stride(0), rows, hkv,
        HEAD_DIM=d, V_DIM=dv, BLOCK_D=block_d, BLOCK_DV=block_dv, HAS_WINDOW=has_window,
    )

    qk_scale = float(scale) * math.log2(math.e)
    common["MIN_SPLIT_KEYS"] = _MIN_SPLIT_KEYS
    strides = (*q.stride(), *k_store.stride()[:3], *v_store.stride()[:3], *out.stride()[:3])
    scalars = (pos.stride(0), t, rows, window_arg, hkv, qk_scale)

    small_t = _small_t(group)
    small = _is_small_step(t, small_t)
    large = 1 - small

    # Split variant (small steps): the tiles cover group * small_t query rows.
    split_m = _split_block_m(group)
    split_tiles = -(-(group * small_t) // split_m)
    splits = _num_splits(b, hkv)
    part_rows = split_tiles * split_m
    part_acc = torch.empty((b * hkv, splits, part_rows, block_dv), dtype=torch.float32,
                           device=q.device)
    part_m = torch.empty((b * hkv, splits, part_rows), dtype=torch.float32, device=q.device)
    part_l = torch.empty((b * hkv, splits, part_rows), dtype=torch.float32, device=q.device)
    if not _statically_zero(small):
        wrap_triton(_attend_kernel)[(split_tiles * small, b * hkv, splits)](
            q, k_store, v_store, pos, out, part_acc, part_m, part_l,
            *strides, *scalars, splits,
            BLOCK_M=split_m, PART_ROWS=part_rows, SPLIT=True, **common,
        )
        wrap_triton(_combine_splits_kernel)[(split_tiles * small, b * hkv, 1)](
            pos, out, part_acc, part_m, part_l,
            *out.stride()[:3], pos.stride(0), t, rows, window_arg, hkv, splits,
            GROUP=group, V_DIM=dv, BLOCK_DV=block_dv, BLOCK_M=split_m, BLOCK_N=block_n,
            PART_ROWS=part_rows, MIN_SPLIT_KEYS=_MIN_SPLIT_KEYS, HAS_WINDOW=has_window,
        )

    # Tiled variant (larger steps, e.g. prefill): one program per query tile, no split.
    tiled_tiles = (group * t + _TILED_BLOCK_M - 1) // _TILED_BLOCK_M
    if not _statically_zero(large):
        wrap_triton(_attend_kernel)[(tiled_tiles * large, b * hkv, 1)](
            q, k_store, v_store, pos, out, part_acc, part_m, part_l,
            *strides, *scalars, 1,
            BLOCK_M=_TILED_BLOCK_M, PART_ROWS=part_rows, SPLIT=False, **common,
        )
    return out


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
) -> torch.Tensor:
    """Write this step's rows into ``k_store``/``v_store`` in place and attend over the valid rows.

    Same signature and semantics as ``portable_update_and_attend``: q ``[B,Hq,T,D]``, k
    ``[B,Hkv,T,D]``, v ``[B,Hkv,T,Dv]`` (any strides), position int64 ``[T]`` or ``[T,1]``,
    storage ``[B,Hkv,rows,D|Dv]``; ``window`` None is a flat layer, an int a ring attending the
    newest ``window`` positions (rows by :func:`offgraph_export.specs.manifest.storage_row`). Returns
    ``[B,Hq,T,Dv]`` in ``out_dtype``. Calls the ``offgraph_lowered::triton_update_and_attend`` op,
    so ``torch.export`` records one node and AOTInductor compiles its kernels. ``rope_cos``/
    ``rope_sin`` (one-token steps only): q and k are unrotated and the kernel applies the rotary
    embedding ``x * cos + rotate_half(x) * sin`` with these ``D``-value rows.
    """
    if _TRITON_IMPORT_ERROR is not None:
        raise ExportError(
            "the triton step implementation needs the 'triton' package "
            f"(pip install offgraph-export[triton]); importing it failed: {_TRITON_IMPORT_ERROR}. "
            "Use the portable step instead."
        )
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ExportError(f"window must be None (flat) or a positive int, got {window!r}")
    return _lowered_step_op(
        q, k, v, position, k_store, v_store, window, float(scale),
        out_dtype, rope_cos, rope_sin,
    )
