"""Triton batched step over paged storage (design section 10, ``triton_paged``): write every token's
K/V row, then attend each token over its own session's rows only, reading nothing else.

Same contract as :func:`offgraph_export.kernels.portable_paged.portable_paged_update_and_attend`
(the reference semantics). The portable step gathers every row a session may hold and masks; these
kernels take their loop bounds from each token's position and its session's length (read on the
device), so a step costs what the live histories cost.

How it is put together
----------------------
* One custom op, ``offgraph_lowered::triton_paged_update_and_attend`` (:data:`OP_NAME`), made with
  ``torch.library.triton_op`` and declared to mutate ``k_store``/``v_store``; its argument list is
  the portable step's (``window`` is ``Optional[int]``: None for a flat layer). ``torch.export``
  keeps it as one node (its fake implementation is this module's host code run on fake tensors,
  which ``triton_op`` derives), and AOTInductor compiles the kernels it launches through
  ``torch.library.wrap_triton`` into the package. :func:`triton_paged_update_and_attend` is the
  plain function the strip pass calls (``step_impls.resolve_step_impl(..., paged=True)``).
* Host code only does shape arithmetic (``T`` and the pool's pages are dynamic in export: grids
  and buffer sizes are integer expressions of them, no Python control flow on tensor values, no
  ``.item()``). What the device holds (positions, slots, page tables, lengths) is read only inside
  the kernels, so a CUDA graph replays the same grid for any batch contents.
* Any strides of q/k/v/position (a step of several tokens): copied first into the one layout of their shape
  (:func:`~offgraph_export.kernels.portable.dense_copy`), because the strides the kernels are
  given are numbers fixed at export and AOTInductor may lay these tensors out otherwise (see
  :mod:`~offgraph_export.kernels.triton_attend`).

Kernels, launched in this order on one stream, per layer:

1. ``_paged_write_kernel``, grid ``(T, Hkv)``: token ``t``'s k and v rows of one kv head, cast to
   the storage dtype, to their row: flat, pool row ``token_rows[t]`` (page ``r // page_size``, row
   ``r % page_size`` of ``[pages, page_size, Hkv, D]``); ring, row ``position % rows`` of slot
   ``token_slots[t]`` of ``[slots, Hkv, rows, D]``. A row outside the storage is dropped.
2. ``_paged_attend_kernel``, grid ``(T, Hkv, S)``: program ``(t, h, s)`` attends token ``t``'s
   query group (the ``Hq / Hkv`` query heads of kv head ``h``, one ``tl.dot`` tile of
   ``BLOCK_M = max(16, pow2(group))`` rows) over split ``s`` of its own key range, in ``BLOCK_N``
   blocks with an fp32 online softmax (log2 domain). The key range, all of whose rows hold valid
   positions (so poisoned rows are never loaded, and no ``-inf`` mask meets a loaded NaN):

   - flat: positions ``[0, min(p, pages_per_session * page_size - 1)]``, position ``j`` at pool
     row ``page_table[slot, j // page_size] * page_size + j % page_size`` (``paged_row``). Split
     chunks are whole ``BLOCK_N`` blocks from 0, so where ``BLOCK_N <= page_size`` each block lies
     in one page: one page-table load per block and a contiguous ``BLOCK_N x D`` tile; smaller
     pages look a page up per key row (a ``BLOCK_N``-wide gather of the table, then the tile).
   - ring: positions ``[max(e - rows + 1, 0, p - window + 1), min(p, e)]``, ``e =
     session_lengths[slot] - 1``, position ``j`` at row ``j % rows`` of the slot's ring.

   The range is cut on the device (``attend_common._split_keys``): chunks of at least
   :data:`_MIN_SPLIT_KEYS` keys, so a short history uses one split and the others find an empty
   range. With ``S == 1`` (a runtime scalar) the program writes the output; otherwise every split,
   empty or not, writes its partial ``(m, l, acc)`` rows (an empty one ``-inf, 0, 0``).
3. ``_paged_combine_kernel``, grid ``(T, Hq)`` (empty when ``S == 1``): merges a head's ``S``
   partial rows, all loaded at once.

A one-token step (``T`` the constant 1: the batched artifact's decode method, an eager call) takes
two launches, as the single-session one-token step does (``kernels/attend_decode.py``): no write
kernel (the attention kernel's split 0 writes the row and starts from the token's own key and
value, ``FOLD_WRITE``) and no copies of q/k/v (only their head strides are read, fixed by the
views that make them). On the H200 (2026-12-02, ``scripts/sweep_paged_attention.py``, Llama-1B
attention at 1k history) the three-launch step took 12.1 us per layer for one session against
6.6 us for the single-session two-launch step.

The split count
---------------
``S`` sizes a grid axis and the partial buffers, so it is a host-side function of static things
and of ``T`` (a SymInt in export, an int at launch), never of tensor contents:
``S = ceil(S_all / T)`` with ``S_all = clamp(ceil(programs / Hkv), 1, _MAX_SPLITS)``,
``programs = programs_per_sm * SM count`` (the launch's target, :class:`PagedLaunch`), so a launch
holds about ``Hkv * S_all`` programs whatever ``T`` (one token: the GPU filled by one session's
splits; 64 tokens: one split each). Where the longest history a token can have (``max_keys``:
``pages_per_session * page_size`` flat, ``min(window, rows)`` ring) fits one split of
``min_split_keys`` keys, ``S`` is the constant 1 and no combine is launched. Otherwise the
capacity does not cap ``S``: splits past a token's history find an empty range and cost an
early-exiting program each. Capping ``S_all`` by the capacity before dividing by ``T`` (as until
2026-12-02) gave a 2048-row capacity 32 splits at one token and a 16-token step 2 splits, 256
programs on 132 SMs (1.7 TB/s of K/V read on the H200 at 16 sessions of 1k history); a cap
after the division (``min(S_cap, ceil(S_all / T))`` written with floor divisions) failed to
re-trace on torch 2.11 (sympy: "exponent must be non-negative"). Only one floor division by
``T``, which export and AOTInductor keep symbolic (no guards, no ``Max``/``Min``).

Limits: a token is one program per (kv head, split), so a chunked-prefill token reads its history
on its own (tokens of one session share it only through the cache); a ring token whose slot holds
nothing (``session_lengths[slot] == 0``) gets zeros where the portable step gives NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from offgraph_export.errors import ExportError
from offgraph_export.kernels.attend_common import (
    AttendLaunch,
    _block_accumulate,
    _block_scores,
    _finite_max,
    _normalized,
    _rotate_half,
    _split_keys,
    attention_output,
    rope_rows,
)
from offgraph_export.kernels.portable import dense_copy
from offgraph_export.kernels.triton_base import TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR
from offgraph_export.kernels.triton_base import pow2_at_least, sm_count, tl, triton

__all__ = ["triton_paged_update_and_attend", "OP_NAME", "PagedLaunch", "default_launch", "paged_step"]

OP_NAME = "offgraph_lowered::triton_paged_update_and_attend"

#: Attention programs a launch aims for, per SM (sets ``S_all``: see the module docstring).
_PROGRAMS_PER_SM = 4
#: Upper bound on the splits of a token's key range (sizes the partial buffers).
_MAX_SPLITS = 64
#: A split gets at least this many keys (a short history uses fewer splits).
_MIN_SPLIT_KEYS = 64
#: Upper bound on the key block (``AttendLaunch`` picks 64 or 32 by the row's bytes).
_MAX_BLOCK_N = 64
#: Launch configuration of the attention kernel: two warps (its tile has 16 query rows); K/V
#: loads pipelined two stages deep, three where the head dims are at most 64. Chosen with the
#: split settings above on an H200 (bf16, Hkv 8, group 4, 1-64 sessions at 1k-8k history, pages
#: of 16 and 64; 8 and 2 warps, 1-4 stages, 32- and 16-key blocks, 2-6 programs per SM, 32-128
#: keys per split tried): against 4 warps, 2 programs per SM and 128-key splits, up to 1.5x
#: faster (32 sessions at 4k) and within 3% where not faster (one session); D=128, 64 sessions
#: at 8k history: 490 us, about 4.4 TB/s of K/V read.
_NUM_WARPS = 2
_NUM_STAGES = 2
_NUM_STAGES_SMALL_HEADS = 3
#: Keeps the combine's gate in {0, 1} for any T below it (see :func:`_combine_gate`).
_BIG = 1 << 30


@dataclass(frozen=True)
class PagedLaunch:
    """The attention kernel's launch settings (the split rule's inputs and Triton's). The step
    uses :func:`default_launch`; ``scripts/sweep_paged_attention.py`` passes others."""

    programs_per_sm: int
    min_split_keys: int
    max_block_n: int
    num_warps: int
    num_stages: int
    num_stages_small_heads: int


def default_launch() -> PagedLaunch:
    """The settings above (read when a step is traced, so tests can patch them)."""
    return PagedLaunch(_PROGRAMS_PER_SM, _MIN_SPLIT_KEYS, _MAX_BLOCK_N, _NUM_WARPS, _NUM_STAGES,
                       _NUM_STAGES_SMALL_HEADS)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_destination(
    slot, pos, r, n_outer, ring_rows, h, ks_0, ks_1, ks_2, vs_0, vs_1, vs_2,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Offsets of a token's K and V row of kv head ``h`` in storage, and whether it has one:
    flat (``n_outer`` pages), pool row ``r`` (page ``r // PAGE_SIZE``, row ``r % PAGE_SIZE``;
    strides page, row in page, head); ring (``n_outer`` slots), row ``pos % ring_rows`` of slot
    ``slot`` (strides slot, head, row). A destination outside the storage is not ok (offset 0).

    Values only, no pointers, and the callers load its inputs in their own bodies: a store's
    address made from a helper call's result makes torch's mutation analysis mark every pointer
    argument of that call as written (``attend_common._tile_rows``)."""
    if HAS_WINDOW:
        ok = (slot >= 0) & (slot < n_outer) & (pos >= 0)
        slot = tl.where(ok, slot, 0)
        row = tl.where(ok, pos % ring_rows, 0)
        k_dst = slot * ks_0 + h * ks_1 + row * ks_2
        v_dst = slot * vs_0 + h * vs_1 + row * vs_2
    else:
        ok = (r >= 0) & (r < n_outer * PAGE_SIZE)
        r = tl.where(ok, r, 0)
        page = r // PAGE_SIZE
        within = r % PAGE_SIZE
        k_dst = page * ks_0 + within * ks_1 + h * ks_2
        v_dst = page * vs_0 + within * vs_1 + h * vs_2
    return k_dst, v_dst, ok


@triton.jit
def _paged_write_kernel(
    k_ptr, v_ptr, pos_ptr, slots_ptr, rows_ptr, k_store_ptr, v_store_ptr,
    sk_h, sk_t, sk_d,
    sv_h, sv_t, sv_d,
    ks_0, ks_1, ks_2,
    vs_0, vs_1, vs_2,
    pos_stride, slots_stride, rows_stride, n_outer, ring_rows,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Program (t, kv head h): copy token t's k and v rows of head h into storage, cast to its
    dtype. Flat (``n_outer`` pages): pool row ``token_rows[t]``, storage strides (page, row in
    page, head). Ring (``n_outer`` slots): row ``position % ring_rows`` of slot
    ``token_slots[t]``, strides (slot, head, row). A destination outside the storage (which the
    runtime never passes) is dropped rather than written over memory that is not its own."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    # loaded here, not in a helper: see _row_destination
    slot = tl.load(slots_ptr + t * slots_stride).to(tl.int64)
    pos = tl.load(pos_ptr + t * pos_stride).to(tl.int64)
    r = tl.load(rows_ptr + t * rows_stride).to(tl.int64)
    k_dst, v_dst, ok = _row_destination(
        slot, pos, r, n_outer, ring_rows, h, ks_0, ks_1, ks_2, vs_0, vs_1, vs_2, PAGE_SIZE, HAS_WINDOW,
    )

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < tl.where(ok, HEAD_DIM, 0)
    key = tl.load(k_ptr + h * sk_h + t * sk_t + offs_d * sk_d, mask=d_ok, other=0.0)
    tl.store(k_store_ptr + k_dst + offs_d, key.to(k_store_ptr.dtype.element_ty), mask=d_ok)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < tl.where(ok, V_DIM, 0)
    val = tl.load(v_ptr + h * sv_h + t * sv_t + offs_dv * sv_d, mask=dv_ok, other=0.0)
    tl.store(v_store_ptr + v_dst + offs_dv, val.to(v_store_ptr.dtype.element_ty), mask=dv_ok)


@triton.jit
def _token_key_range(
    pos_ptr, slots_ptr, len_ptr, t, pos_stride, slots_stride, len_stride,
    n_slots, span, ring_rows, window, HAS_WINDOW: tl.constexpr,
):
    """Token ``t``'s slot and the absolute positions ``[lo, hi)`` it attends (int32 scalars; an
    empty range ``hi <= lo`` for a slot outside the page table / rings). Flat: ``[0, p]`` clipped
    to the ``span`` positions its page table can name. Ring: the positions its slot's ring still
    holds (the ``ring_rows`` newest up to ``e = session_lengths[slot] - 1``), at most ``p``, within
    ``window`` of ``p``. Every position of the range is held by its row."""
    p = tl.load(pos_ptr + t * pos_stride).to(tl.int32)
    slot = tl.load(slots_ptr + t * slots_stride).to(tl.int32)
    slot_ok = (slot >= 0) & (slot < n_slots)
    slot = tl.where(slot_ok, slot, 0)
    if HAS_WINDOW:
        e = tl.load(len_ptr + slot * len_stride).to(tl.int32) - 1
        lo = tl.maximum(tl.maximum(e - ring_rows + 1, 0), p - window + 1)
        hi = tl.minimum(p, e) + 1
    else:
        lo = p * 0
        hi = tl.minimum(p + 1, span)
    hi = tl.where(slot_ok, hi, lo)
    return slot, lo, hi


@triton.jit
def _paged_attend_kernel(
    q_ptr, k_store_ptr, v_store_ptr, pos_ptr, slots_ptr, pt_ptr, len_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, k_ptr, v_ptr, rows_ptr, cos_ptr, sin_ptr,
    sq_h, sq_t, sq_d,
    ks_0, ks_1, ks_2,
    vs_0, vs_1, vs_2,
    so_h, so_t,
    sk_h, sk_t, sk_d,
    sv_h, sv_t, sv_d,
    pos_stride, slots_stride, pt_s0, pt_s1, len_stride, rows_stride,
    n_slots, n_pages, span, ring_rows, window, n_kv_heads, qk_scale, num_splits, rope_st,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, ONE_PAGE_PER_BLOCK: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QK_FP32: tl.constexpr, PV_FP32: tl.constexpr,
    FOLD_WRITE: tl.constexpr, ROPE: tl.constexpr,
):
    """Program (token t, kv head h, split s): online-softmax attention of token t's ``GROUP``
    query heads of kv head h over split s of the token's key range (:func:`_token_key_range`).

    Storage strides: flat (page, row in page, head), ring (slot, head, row); head dims contiguous.
    Every key of the range is valid for the token's one position, so a block's only mask is its
    end (and, against a corrupt table, page ids outside the pool): keys outside load as 0 and
    score -inf before the max. ``num_splits == 1``: the output is written here; otherwise the
    split's unnormalized ``(m, l, acc)`` rows go to the partial buffers at
    ``((t * Hkv + h) * num_splits + s) * GROUP + g``, an empty split's as ``(-inf, 0, 0)``.

    ``FOLD_WRITE`` (a one-token step, ``T`` the constant 1, or a step of one row per session:
    every token is its session's only new row, so no token reads a row another token of the step
    writes): no write kernel runs before this one. Split 0 writes the token's row (as
    ``_paged_write_kernel`` would, dropped where its destination is outside the storage) and
    starts its online softmax from the token's own key and value, taken from ``k``/``v`` rounded
    to the storage dtype (as the stored row will be); the splits read the stored positions
    ``[lo, p)``, of which none is the row being written (flat: row ``p`` was never written
    before; ring: row ``p % rows`` held ``p - rows < lo``)."""
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    slot, lo, hi = _token_key_range(
        pos_ptr, slots_ptr, len_ptr, t, pos_stride, slots_stride, len_stride,
        n_slots, span, ring_rows, window, HAS_WINDOW,
    )
    if FOLD_WRITE:
        p_own = tl.load(pos_ptr + t * pos_stride).to(tl.int32)
        own = (hi > lo) & (hi - 1 == p_own)  # the token's own position is the last of its range
        hi = tl.where(own, hi - 1, hi)
    k_lo, k_hi, n_used = _split_keys(lo, hi, split, num_splits, MIN_SPLIT_KEYS, BLOCK_N)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = kvh * GROUP + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_DIM
    q_base = q_ptr + head[:, None] * sq_h + t * sq_t
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_base + offs_d[None, :] * sq_d, mask=q_mask, other=0.0)
    if ROPE:  # given its rotary rows (passes/decode_rope.py; row t at t * rope_st): rotate q here
        cos = tl.load(cos_ptr + t * rope_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * rope_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        q = _rotate_half(q, q_base, offs_d[None, :], sq_d, q_mask, cos[None, :], sin[None, :], HEAD_DIM)
    if QK_FP32:
        q = q.to(tl.float32)
    if HAS_WINDOW:
        k_base = k_store_ptr + slot.to(tl.int64) * ks_0 + kvh * ks_1
        v_base = v_store_ptr + slot.to(tl.int64) * vs_0 + kvh * vs_1
    else:
        k_base = k_store_ptr + kvh * ks_2
        v_base = v_store_ptr + kvh * vs_2
    pt_base = pt_ptr + slot.to(tl.int64) * pt_s0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if FOLD_WRITE:
        first = split == 0
        k_row = k_ptr + kvh * sk_h + t * sk_t
        new_key = tl.load(k_row + offs_d * sk_d, mask=d_ok, other=0.0)
        if ROPE:
            new_key = _rotate_half(new_key, k_row, offs_d, sk_d, d_ok, cos, sin, HEAD_DIM)
        new_key = new_key.to(k_store_ptr.dtype.element_ty)
        new_val = tl.load(v_ptr + kvh * sv_h + t * sv_t + offs_dv * sv_d, mask=dv_ok, other=0.0)
        new_val = new_val.to(v_store_ptr.dtype.element_ty)
        w_slot = tl.load(slots_ptr + t * slots_stride).to(tl.int64)  # loaded here: see _row_destination
        w_pos = tl.load(pos_ptr + t * pos_stride).to(tl.int64)
        w_row = tl.load(rows_ptr + t * rows_stride).to(tl.int64)
        k_dst, v_dst, dst_ok = _row_destination(
            w_slot, w_pos, w_row, n_slots if HAS_WINDOW else n_pages, ring_rows, kvh,
            ks_0, ks_1, ks_2, vs_0, vs_1, vs_2, PAGE_SIZE, HAS_WINDOW,
        )
        write = first & dst_ok
        tl.store(k_store_ptr + k_dst + offs_d, new_key, mask=offs_d < tl.where(write, HEAD_DIM, 0))
        tl.store(v_store_ptr + v_dst + offs_dv, new_val, mask=offs_dv < tl.where(write, V_DIM, 0))
        s_new = tl.sum(q.to(tl.float32) * new_key.to(tl.float32)[None, :], axis=1) * qk_scale
        seen = row_ok & first & own
        m_i = tl.where(seen, s_new.to(tl.float32), float("-inf"))
        l_i = tl.where(seen, 1.0, 0.0)
        acc = l_i[:, None] * new_val.to(tl.float32)[None, :]
    for start in range(k_lo, k_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        if HAS_WINDOW:
            key_ok = j < k_hi
            r = (j % ring_rows).to(tl.int64)
            k_off = r * ks_2
            v_off = r * vs_2
        elif ONE_PAGE_PER_BLOCK:
            # The block starts at a multiple of BLOCK_N (chunks are whole blocks from 0), which
            # divides PAGE_SIZE: one page, one table entry, a contiguous run of rows.
            page = tl.load(pt_base + (start // PAGE_SIZE) * pt_s1)
            page_ok = (page >= 0) & (page < n_pages)
            key_ok = j < tl.where(page_ok, k_hi, start)
            page = tl.where(page_ok, page, 0).to(tl.int64)
            within = (start % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_off = page * ks_0 + within * ks_1
            v_off = page * vs_0 + within * vs_1
        else:
            key_ok = j < k_hi
            page = tl.load(pt_base + (j // PAGE_SIZE) * pt_s1, mask=key_ok, other=0)
            key_ok = key_ok & (page >= 0) & (page < n_pages)
            page = tl.where(key_ok, page, 0).to(tl.int64)
            within = (j % PAGE_SIZE).to(tl.int64)
            k_off = page * ks_0 + within * ks_1
            v_off = page * vs_0 + within * vs_1
        s = _block_scores(q, k_base, k_off, key_ok, 1, offs_d, d_ok, qk_scale, QK_FP32)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _block_accumulate(
            s, v_base, v_off, key_ok, 1, offs_dv, dv_ok, m_i, l_i, acc, PV_FP32
        )

    direct = num_splits == 1
    out_rows = offs_m < tl.where(direct, GROUP, 0)
    result = _normalized(acc, l_i).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + head[:, None] * so_h + t * so_t + offs_dv[None, :],
        result,
        mask=out_rows[:, None] & dv_ok[None, :],
    )
    part_ok = offs_m < tl.where(direct, 0, GROUP)
    part_row = ((t * n_kv_heads + kvh) * num_splits + split) * GROUP + offs_m
    tl.store(part_m_ptr + part_row, m_i, mask=part_ok)
    tl.store(part_l_ptr + part_row, l_i, mask=part_ok)
    tl.store(part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=part_ok[:, None])


@triton.jit
def _paged_combine_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    so_h, so_t, n_kv_heads, num_splits,
    GROUP: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (token t, query head): merge the head's ``num_splits`` partial rows, all loaded at
    once: ``out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)``, M their max (an empty
    split's ``(-inf, 0, 0)`` weighs 0; a token that saw nothing gets 0, not NaN)."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kvh = head // GROUP
    g = head % GROUP
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < num_splits
    part_row = ((t * n_kv_heads + kvh) * num_splits + offs_s) * GROUP + g
    m_s = tl.load(part_m_ptr + part_row, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part_row, mask=s_ok, other=0.0)
    acc_s = tl.load(
        part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], mask=s_ok[:, None], other=0.0
    )
    m_ref = _finite_max(tl.max(m_s, axis=0))
    w = tl.exp2(m_s - m_ref)
    l = tl.sum(l_s * w, axis=0)
    acc = tl.sum(acc_s * w[:, None], axis=0)
    l_safe = tl.where(l > 0.0, l, 1.0)
    tl.store(
        out_ptr + head * so_h + t * so_t + offs_dv,
        (acc / l_safe).to(out_ptr.dtype.element_ty),
        mask=offs_dv < V_DIM,
    )


# ---------------------------------------------------------------------------------------------
# Host side: shape arithmetic that works on ints and SymInts alike
# ---------------------------------------------------------------------------------------------


def _all_splits(hkv: int, device: torch.device, programs_per_sm: int) -> int:
    """``S_all``: splits per token of a one-token step, so that ``Hkv * S_all`` programs come to
    ``programs_per_sm`` per SM, within ``[1, _MAX_SPLITS]``."""
    programs = programs_per_sm * sm_count(device)
    return max(1, min(_MAX_SPLITS, -(-programs // max(1, hkv))))


def _one_split(max_keys, min_split_keys: int) -> bool:
    """Whether the longest history (``max_keys`` keys, a static bound; a SymInt never counts)
    fits one split of ``min_split_keys`` keys: then ``S`` is the constant 1."""
    return isinstance(max_keys, int) and max_keys <= min_split_keys


def _num_splits(t, s_all: int, one_split: bool):
    """``S = ceil(S_all / T)`` (an int, or a SymInt expression of a symbolic ``T``), 1 where
    ``one_split``."""
    return 1 if one_split else (s_all + t - 1) // t


def _combine_gate(t, s_all: int, one_split: bool):
    """1 if ``S > 1`` else 0 for ``1 <= T < _BIG`` (``T <= S_all - 1``), with floor division
    only (an expression export keeps symbolic: no guard)."""
    return 0 if one_split else (s_all - 1 + _BIG - t) // _BIG


def _statically_zero(n) -> bool:
    """True only for a concrete 0 (a SymInt grid is left to the launcher, which skips empty
    grids)."""
    return isinstance(n, int) and n == 0


def _paged_step(
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
    window: Optional[int],
    scale: float,
    out_dtype: torch.dtype,
    rope_cos: Optional[torch.Tensor] = None,
    rope_sin: Optional[torch.Tensor] = None,
    one_row_per_session: bool = False,
) -> torch.Tensor:
    """Body of the triton_op (``window`` None: a flat layer)."""
    return paged_step(q, k, v, position, k_store, v_store, token_slots, token_rows, page_table,
                      session_lengths, window, scale, out_dtype, rope_cos=rope_cos, rope_sin=rope_sin,
                      one_row_per_session=one_row_per_session)


def paged_step(
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
    window: Optional[int],
    scale: float,
    out_dtype: torch.dtype,
    settings: Optional[PagedLaunch] = None,
    rope_cos: Optional[torch.Tensor] = None,
    rope_sin: Optional[torch.Tensor] = None,
    one_row_per_session: bool = False,
) -> torch.Tensor:
    """The op's host code, with the launch ``settings`` (default :func:`default_launch`):
    eager callers (the sweep script) pass others. ``rope_cos``/``rope_sin``: the step's rotary
    rows (``D`` values each per token, q's dtype); q and k then arrive unrotated and the attention
    kernel rotates them (``passes/decode_rope.py``).

    ``one_row_per_session``: the caller promises that every token of the step is its session's
    only new row (a decode step of several sessions; padding tokens, all alike, may share the
    scratch row). Then, as for one token, the row writes are folded into the attention kernel (no
    write kernel), q/k/v are read where they lie (no copies: the caller's strides are the
    kernels', which holds for an eager call), and rotary rows may come one per token. A step
    that breaks the promise reads rows of its own step that are not written yet."""
    settings = settings or default_launch()
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    torch._check(b == 1, lambda: "a batched step packs its sessions along the tokens: batch must be 1")
    torch._check(hq % hkv == 0, lambda: f"Hq={hq} must be a multiple of Hkv={hkv}")
    torch._check(k.shape[2] == t, lambda: "k must have as many tokens as q")
    torch._check(v.shape[2] == t, lambda: "v must have as many tokens as q")
    torch._check(
        k_store.stride(-1) == 1 and v_store.stride(-1) == 1,
        lambda: "storage rows must be contiguous (last-dim stride 1)",
    )
    flat = window is None
    if flat:
        torch._check(k_store.shape[2] == hkv, lambda: "pool kv heads must match k")
        page_size = int(k_store.shape[1])  # static: the manifest's page_size
        ring_rows = 1  # unread
        max_keys = page_table.shape[1] * page_size
    else:
        torch._check(k_store.shape[1] == hkv, lambda: "ring kv heads must match k")
        page_size = 1  # unread
        ring_rows = k_store.shape[2]
        max_keys = ring_rows if not isinstance(ring_rows, int) else min(ring_rows, window)
    for dim in range(3):
        torch._check(k_store.shape[dim] == v_store.shape[dim], lambda: "k and v storage must agree but for the head dim")
    n_outer = k_store.shape[0]  # flat: pages; ring: slots
    one_token = isinstance(t, int) and t == 1
    fold = one_token or one_row_per_session
    if fold:
        # One token (the decode method, an eager call): the kernels use only the head and head-dim
        # strides, which the views making q/k/v fix in any trace (kernels/triton_attend.py); no
        # copy, and the row write is folded into the attention kernel (FOLD_WRITE).
        pos = position.reshape(-1)
    else:
        # Strides become numbers at export: copy into the one layout of the shape (module docstring).
        q, k, v = dense_copy(q), dense_copy(k), dense_copy(v)
        pos = dense_copy(position).reshape(-1)
    torch._check(pos.shape[0] == t, lambda: "position must hold one entry per token")
    torch._check(token_slots.shape[0] == t, lambda: "token_slots must hold one entry per token")
    torch._check(token_rows.shape[0] == t, lambda: "token_rows must hold one entry per token")

    launch = AttendLaunch.for_step(q, k, v, k_store, v_store, window, scale)
    group = launch.group
    block_n = min(launch.block_n, settings.max_block_n)
    rotary = rope_rows(rope_cos, rope_sin, q, k, launch.head_dim, one_token, per_token=one_row_per_session)
    rope = rotary is not None
    cos, sin = rotary if rotary is not None else (pos, pos)  # unread without ROPE
    rope_st = cos.stride(0) if rope and cos.dim() == 2 else 0
    block_m = pow2_at_least(group)
    out = attention_output(1, hq, t, launch.v_dim, out_dtype, q.device)
    if _statically_zero(t):
        return out
    wrap_triton = torch.library.wrap_triton

    if not fold:
        wrap_triton(_paged_write_kernel)[(t, hkv, 1)](
            k, v, pos, token_slots, token_rows, k_store, v_store,
            *k.stride()[1:], *v.stride()[1:], *k_store.stride()[:3], *v_store.stride()[:3],
            pos.stride(0), token_slots.stride(0), token_rows.stride(0), n_outer, ring_rows,
            PAGE_SIZE=page_size, HEAD_DIM=launch.head_dim, V_DIM=launch.v_dim,
            BLOCK_D=launch.block_d, BLOCK_DV=launch.block_dv, HAS_WINDOW=not flat,
        )

    s_all = _all_splits(hkv, q.device, settings.programs_per_sm)
    one_split = _one_split(max_keys, settings.min_split_keys)
    splits = _num_splits(t, s_all, one_split)
    gate = _combine_gate(t, s_all, one_split)
    if _statically_zero(gate):
        # Never written: S is 1 and the attention kernel writes the output directly.
        part_acc, part_m, part_l = (torch.empty((1,), dtype=torch.float32, device=q.device) for _ in range(3))
    else:
        part = t * hkv * splits * group
        part_acc = torch.empty((part, launch.block_dv), dtype=torch.float32, device=q.device)
        part_m = torch.empty((part,), dtype=torch.float32, device=q.device)
        part_l = torch.empty((part,), dtype=torch.float32, device=q.device)

    wrap_triton(_paged_attend_kernel)[(t, hkv, splits)](
        q, k_store, v_store, pos, token_slots, page_table, session_lengths, out,
        part_acc, part_m, part_l, k, v, token_rows, cos, sin,
        *q.stride()[1:], *k_store.stride()[:3], *v_store.stride()[:3], out.stride(1), out.stride(2),
        *k.stride()[1:], *v.stride()[1:],
        pos.stride(0), token_slots.stride(0), page_table.stride(0), page_table.stride(1),
        session_lengths.stride(0), token_rows.stride(0),
        page_table.shape[0] if flat else n_outer, n_outer, max_keys if flat else 0, ring_rows,
        launch.window, hkv, launch.qk_scale, splits, rope_st,
        GROUP=group, HEAD_DIM=launch.head_dim, V_DIM=launch.v_dim,
        BLOCK_D=launch.block_d, BLOCK_DV=launch.block_dv, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, ONE_PAGE_PER_BLOCK=flat and block_n <= page_size,
        MIN_SPLIT_KEYS=settings.min_split_keys, HAS_WINDOW=not flat,
        QK_FP32=launch.qk_fp32, PV_FP32=launch.pv_fp32, FOLD_WRITE=fold, ROPE=rope,
        num_warps=settings.num_warps,
        num_stages=(settings.num_stages_small_heads if max(launch.block_d, launch.block_dv) <= 64
                    else settings.num_stages),
    )
    if not _statically_zero(gate):
        wrap_triton(_paged_combine_kernel)[(t * gate, hq, 1)](
            out, part_acc, part_m, part_l, out.stride(1), out.stride(2), hkv, splits,
            GROUP=group, V_DIM=launch.v_dim, BLOCK_DV=launch.block_dv,
            BLOCK_S=pow2_at_least(s_all, floor=2), num_warps=4,
        )
    return out


if _TRITON_IMPORT_ERROR is None:
    _paged_step_op = torch.library.triton_op(OP_NAME, mutates_args={"k_store", "v_store"})(_paged_step)


def triton_paged_update_and_attend(
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
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    one_row_per_session: bool = False,
) -> torch.Tensor:
    """Write every token's K/V row into ``k_store``/``v_store`` in place and attend each token
    over its own session's valid rows (design section 10).

    Same signature and semantics as ``portable_paged_update_and_attend``: q ``[1, Hq, T, D]``,
    k ``[1, Hkv, T, D]``, v ``[1, Hkv, T, Dv]`` (any strides), position ``[T]`` or ``[T, 1]``;
    flat storage (``window`` None) a page pool ``[pages, page_size, Hkv, D|Dv]``, ring storage
    (``window`` an int >= 1) ``[slots, Hkv, rows, D|Dv]``, head dims contiguous; the four batch
    inputs (int32) as in the design. Returns ``[1, Hq, T, Dv]`` in ``out_dtype``. Calls the
    ``offgraph_lowered::triton_paged_update_and_attend`` op, so ``torch.export`` records one node
    and AOTInductor compiles its kernels. ``rope_cos``/``rope_sin`` (one-token steps only): q and
    k are unrotated and the kernel applies ``x * cos + rotate_half(x) * sin`` with these rows.
    ``one_row_per_session``: every token is its session's only new row (the batched artifact's
    sessions method, ``passes/decode_sessions.py``): see :func:`paged_step`; rotary rows may then
    come one per token."""
    if _TRITON_IMPORT_ERROR is not None:
        raise ExportError(
            "the triton paged step needs the 'triton' package "
            f"(pip install offgraph-export[triton]); importing it failed: {_TRITON_IMPORT_ERROR}. "
            "Use the portable step instead."
        )
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ExportError(f"window must be None (flat) or a positive int, got {window!r}")
    return _paged_step_op(
        q, k, v, position, k_store, v_store, token_slots, token_rows, page_table, session_lengths,
        window, float(scale), out_dtype, rope_cos, rope_sin, bool(one_row_per_session),
    )
