"""What the Triton step's attention kernels share: the multi-token family
(:mod:`~offgraph_export.kernels.attend_prefill`) and the one-token one
(:mod:`~offgraph_export.kernels.attend_decode`), each a kernel that attends and one that combines
splits.

Why a module of its own: the kernels follow one set of rules (the row of a position, the query rows
of a tile and the oldest position they may see, how a key range is cut into splits, how a block of
keys enters the online softmax, where a split leaves its partial rows, the rotary embedding) and
each rule is written here once, as a jit helper that Triton inlines into the kernels, so the kernels
cannot drift apart. Host side: the launch configuration both launchers take (:class:`AttendLaunch`,
derived once per step from the tensors), the split count and the partial-row buffers.

Soft-capping and sinks (docs/design.md section 2) enter as two more rules: :func:`_soft_capped`
caps each block of scores before the running max sees it, and :func:`_join_sinks` folds a query
head's sink logit into the online softmax as one more key whose value is 0, once per query row (by
split 0 of its tile), so the combine kernels merge it like any other key and need no change. The
paged kernels (``kernels/paged_attend.py``) share the other helpers but implement neither.

Partial rows: a split that shares its tile's key range with others leaves an unnormalized
``(max, sum, acc)`` row per query row at ``(b * Hkv + kv head, split, query row)`` of three fp32
buffers (:func:`partial_buffers`, addressed by :func:`_part_rows`), which a combine kernel merges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from offgraph_export.kernels.triton_base import INTERPRETED, pow2_at_least, tl, triton

__all__ = ["AttendLaunch", "attention_output", "partial_buffers", "rope_rows", "split_count"]

_LOG2E = math.log2(math.e)

#: Upper bound on splits per query tile; also sizes the partial-result buffers.
_MAX_SPLITS = 64
#: Splits per tile where the batch is symbolic (the count is static: it sizes the buffers).
_SYMBOLIC_BATCH_SPLITS = 16


# ---------------------------------------------------------------------------------------------
# Jit helpers (inlined into the kernels of both families)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _storage_row(position, rows):
    """The storage row of an absolute position: :func:`offgraph_export.specs.manifest.storage_row`
    (``position mod rows``), restated here because jit code cannot call host Python. Positions are
    non-negative, where Triton's truncating ``%`` and Python's floor ``%`` agree."""
    return position % rows


@triton.jit
def _can_store(position, rows, HAS_WINDOW: tl.constexpr):
    """Whether the storage can hold ``position``: not negative, and for a flat layer (which never
    wraps) below its rows. The runtime never passes another; a kernel drops such a write rather
    than write over another position's row."""
    return (position >= 0) & ((position < rows) | HAS_WINDOW)


@triton.jit
def _batch_and_head(pid_bh, n_kv_heads):
    """``(batch, kv head)`` of a program axis that runs over ``b * Hkv + kv head``, as int64 (they
    scale strides)."""
    return (pid_bh // n_kv_heads).to(tl.int64), (pid_bh % n_kv_heads).to(tl.int64)


@triton.jit
def _rows_if(offs_m, n_rows, cond):
    """``offs_m < n_rows`` where the scalar ``cond`` holds, else all false.

    Written as one comparison rather than ``(offs_m < n_rows) & cond``: the Triton interpreter
    (used by the CPU tests) turns a block ``&`` a scalar bool into an int mask it then rejects."""
    return offs_m < tl.where(cond, n_rows, 0)


@triton.jit
def _tile_rows(T, pid_m, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query rows of tile ``pid_m``: row m is token ``m // GROUP`` of query head
    ``m % GROUP`` within the kv head's group. Returns (token, head-in-group, row is real, the
    row indices).

    No pointer goes into this helper, and nothing it returns is loaded from memory: torch's
    mutation analysis of a Triton kernel (``triton_kernel_wrap.analyze_kernel_access``) walks
    back from every store's address, through a helper call to all of its arguments, and marks
    each pointer it reaches as written. The output's store address is made of these rows, so a
    helper that also took ``pos_ptr`` (as one that loaded the positions here did) made torch
    treat the positions as mutated: a clone per call, and on torch 2.11 an Inductor pattern
    replacement that failed to compile (``decompose_triton_kernel_wrapper_functional``)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP * T
    tok = offs_m // GROUP
    grp = offs_m % GROUP
    return tok, grp, row_ok, offs_m


@triton.jit
def _query_positions(pos_ptr, pos_stride, tok, row_ok):
    """Each query row's absolute position (int32; 0 for rows that are not real). Its result
    feeds key ranges and masks, never a store's address (see :func:`_tile_rows`)."""
    return tl.load(pos_ptr + tok * pos_stride, mask=row_ok, other=0).to(tl.int32)


@triton.jit
def _oldest_key(last, oldest_query, rows, window, HAS_WINDOW: tl.constexpr):
    """The oldest absolute position some query may attend to: one the storage still holds after
    the step's writes (the ``rows`` newest up to ``last``, the step's last position; every one for
    a flat layer, which never wraps), not negative (written at all), and with a window (ring
    layers) within ``window`` of the oldest query ``oldest_query`` (unread without one)."""
    lo = tl.maximum(last - rows + 1, 0)
    if HAS_WINDOW:
        lo = tl.maximum(lo, oldest_query - window + 1)
    return lo


@triton.jit
def _tile_key_range(pos_ptr, pos_stride, T, rows, window, qpos, row_ok, HAS_WINDOW: tl.constexpr):
    """Absolute positions ``[lo, hi)`` some query of the tile may attend to, as int32 scalars:
    ``(.., max_pos]`` from :func:`_oldest_key` on (the step's last position is ``position[T-1]``).
    Every position in the range is held by its row, so loops over it never read a row that was
    not written. An empty tile gets ``hi <= lo``."""
    hi = tl.max(tl.where(row_ok, qpos, -1), axis=0) + 1
    last = tl.load(pos_ptr + (T - 1) * pos_stride).to(tl.int32)
    oldest = tl.min(tl.where(row_ok, qpos, 1 << 30), axis=0)  # unread without a window
    return _oldest_key(last, oldest, rows, window, HAS_WINDOW), hi


@triton.jit
def _split_plan(lo, hi, num_splits, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """How a tile's key range ``[lo, hi)`` is cut into splits: (keys per split, splits used).

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
def _split_keys(lo, hi, split, num_splits, MIN_SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split ``split``'s keys ``[k_lo, k_hi)`` of the range ``[lo, hi)`` under :func:`_split_plan`,
    and the number of splits the plan uses (a split past them gets an empty range)."""
    chunk, n_used = _split_plan(lo, hi, num_splits, MIN_SPLIT_KEYS, BLOCK_N)
    k_lo = lo + split * chunk
    return k_lo, tl.minimum(k_lo + chunk, hi), n_used


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
def _soft_capped(s, cap_scale, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain from :func:`_block_scores`'s (or the new key's) ``s``: with
    ``SOFTCAP`` the caller scaled by ``scale / softcap`` (:class:`AttendLaunch`), so
    ``tanh(s) * softcap * log2(e)`` (``cap_scale``) is the capped score in the log2 domain; else
    ``s`` as it is. ``tanh`` is written ``2 sigmoid(2s) - 1`` (fp32; no ``tanh`` in every Triton
    backend and the interpreter): it saturates to +-1 rather than overflowing. fp32 out, whatever
    type the compiler gives the ``cap_scale`` argument (see :func:`_block_scores`)."""
    if SOFTCAP:
        s = ((2.0 * tl.sigmoid(2.0 * s) - 1.0) * cap_scale).to(tl.float32)
    return s


@triton.jit
def _join_sinks(sink_ptr, head, rows, m_i, l_i, acc):
    """Fold each query row's sink logit (``sink_ptr[head]``, any float dtype, taken in fp32 and to
    the log2 domain) into its online-softmax state as a key of value 0: the max takes it, the sum
    gains ``2^(sink - max)``, the accumulator only rescales. Rows outside ``rows`` (not real, or
    another split's) are left as they are, so each row takes its sink once."""
    sink = tl.load(sink_ptr + head, mask=rows, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    m_ref = _finite_max(m_new)
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.exp2(sink - m_ref)
    return m_new, l_i, acc * alpha[:, None]


@triton.jit
def _finite_max(m):
    """The running max to subtract before ``exp2``: a row with nothing seen yet keeps
    ``m = -inf``; subtract 0 then so ``exp2`` gives 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _block_accumulate(s, v_base, key_row, key_ok, sv_r, offs_dv, dv_ok, m_i, l_i, acc, PV_FP32: tl.constexpr):
    """One online-softmax step over a block of masked scores ``s`` (-inf where unseen) and the
    block's stored values: returns the new ``(max, sum, acc)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = _finite_max(m_new)
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
def _normalized(acc, l_i):
    """The softmax-weighted sum of a tile's rows, ``acc / sum`` (fp32); a row that saw nothing
    (sum 0) gives its ``acc``, 0, rather than NaN."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_safe[:, None]


@triton.jit
def _part_rows(pid_bh, num_splits, split, PART_ROWS: tl.constexpr, row):
    """Index of query row ``row`` of split ``split`` in the partial buffers of the program axis
    ``pid_bh`` (``b * Hkv + kv head``): ``PART_ROWS`` rows per (head, split), as int64."""
    return (pid_bh.to(tl.int64) * num_splits + split) * PART_ROWS + row


@triton.jit
def _store_split(
    out_tile, result, part_acc_ptr, part_m_ptr, part_l_ptr, part_row, m_i, l_i, acc,
    offs_m, n_rows, offs_dv, dv_ok, split, n_used, BLOCK_DV: tl.constexpr,
):
    """Where a split leaves its tile (query rows ``offs_m < n_rows``): with a single split in use
    it holds the whole answer, so split 0 writes ``result`` to the output and the combine kernel
    leaves the tile alone; with several, each split in use writes its unnormalized
    ``(max, sum, acc)`` rows at ``part_row`` for the combine kernel."""
    direct = _rows_if(offs_m, n_rows, (n_used == 1) & (split == 0))
    tl.store(out_tile, result, mask=direct[:, None] & dv_ok[None, :])
    keep = _rows_if(offs_m, n_rows, (n_used > 1) & (split < n_used))
    tl.store(part_m_ptr + part_row, m_i, mask=keep)
    tl.store(part_l_ptr + part_row, l_i, mask=keep)
    tl.store(part_acc_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=keep[:, None])


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


# ---------------------------------------------------------------------------------------------
# Host side: shape arithmetic that works on ints and SymInts alike
# ---------------------------------------------------------------------------------------------


def rope_rows(
    rope_cos: Optional[torch.Tensor], rope_sin: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
    head_dim: int, one_token: bool, per_token: bool = False,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A step's rotary rows, checked (given together, an even head dim shared by q and k,
    ``head_dim`` values a row, q's dtype) and flattened: ``[head_dim]`` for a one-token step,
    ``[T, head_dim]`` (row ``t`` token ``t``'s) where ``per_token`` (a paged step of one row per
    session, :func:`~offgraph_export.kernels.paged_attend.paged_step`); None without them. The
    one-token kernels (``attend_decode``, ``paged_attend``) and the paged one-row-per-session
    kernel rotate with them."""
    if rope_cos is None and rope_sin is None:
        return None
    d = head_dim
    t = q.shape[2]
    torch._check(rope_cos is not None and rope_sin is not None, lambda: "rotary rows come as cos and sin")
    torch._check(one_token or per_token, lambda: "rotary rows are taken by one-token steps only (or paged steps of one row per session)")
    torch._check(d % 2 == 0 and k.shape[-1] == d, lambda: "rotary rows need an even head dim shared by q and k")
    rows = 1 if one_token else t
    torch._check(rope_cos.numel() == rows * d and rope_sin.numel() == rows * d,
                 lambda: f"rotary rows must hold {d} values per token")
    torch._check(rope_cos.dtype == q.dtype == k.dtype == rope_sin.dtype, lambda: "rotary rows, q and k share a dtype")
    if one_token:
        return rope_cos.reshape(d).contiguous(), rope_sin.reshape(d).contiguous()
    return rope_cos.reshape(t, d).contiguous(), rope_sin.reshape(t, d).contiguous()


@dataclass(frozen=True)
class AttendLaunch:
    """What every attention launch of one step shares: the kernels' compile-time constants and
    the step's scalar arguments, derived once from the step's tensors (:meth:`for_step`).

    Head dims and the group size are constexprs of the kernels, so they are plain ints (in export
    they are static anyway; ``int()`` on a SymInt would guard)."""

    #: query heads per kv head
    group: int
    head_dim: int
    v_dim: int
    #: the head dims rounded up to a power of two (``tl.arange`` and ``tl.dot`` need it)
    block_d: int
    block_dv: int
    #: keys per block of the key loops
    block_n: int
    #: a ring layer (attends the newest ``window`` positions); else flat
    has_window: bool
    #: fp32 (IEEE, not TF32) dot products for q.k and p.v, else tensor cores on 16-bit operands
    qk_fp32: bool
    pv_fp32: bool
    #: the ring's window as a kernel argument (an int; 0, unread, for a flat layer)
    window: int
    #: ``scale * log2(e)``: scores are in the log2 domain, so ``exp2`` does the softmax; with
    #: soft-capping ``scale / softcap``, the argument of its ``tanh`` (:func:`_soft_capped`)
    qk_scale: float
    #: soft-capping (``SOFTCAP``): ``cap_scale = softcap * log2(e)`` (1.0, unread, without)
    softcap: bool = False
    cap_scale: float = 1.0
    #: per-query-head sink logits (``HAS_SINKS``; :func:`_join_sinks`)
    has_sinks: bool = False

    @classmethod
    def for_step(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        window: Optional[int],
        scale: float,
        softcap: Optional[float] = None,
        has_sinks: bool = False,
    ) -> AttendLaunch:
        """The configuration of a step of ``q``/``k``/``v`` over this storage (``window`` None:
        a flat layer; ``softcap`` None: no soft-capping; ``has_sinks``: the step takes sinks)."""
        d, dv = int(q.shape[-1]), int(v.shape[-1])
        block_d, block_dv = pow2_at_least(d), pow2_at_least(dv)
        # The interpreter computes bf16 dots wrongly (triton_base.INTERPRETED): fp32 there.
        sixteen_bit = (torch.float16,) if INTERPRETED else (torch.float16, torch.bfloat16)
        # Key block: 64 rows while a K/V tile row is <= 256 bytes (bf16 x 128), else 32, so the
        # pipelined K and V tiles stay well inside shared memory (fp32 x 128, 16-bit x 256).
        row_bytes = max(block_d, block_dv) * k_store.element_size()
        return cls(
            group=int(q.shape[1] // k.shape[1]),
            head_dim=d,
            v_dim=dv,
            block_d=block_d,
            block_dv=block_dv,
            block_n=64 if row_bytes <= 256 else 32,
            has_window=window is not None,
            qk_fp32=not (q.dtype == k_store.dtype and k_store.dtype in sixteen_bit),
            pv_fp32=v_store.dtype not in sixteen_bit,
            window=window if window is not None else 0,
            qk_scale=float(scale) / softcap if softcap is not None else float(scale) * _LOG2E,
            softcap=softcap is not None,
            cap_scale=float(softcap) * _LOG2E if softcap is not None else 1.0,
            has_sinks=has_sinks,
        )

    def constexprs(self) -> dict[str, Any]:
        """The compile-time arguments every attention kernel takes, by the kernels' names."""
        return dict(
            GROUP=self.group, HEAD_DIM=self.head_dim, V_DIM=self.v_dim,
            BLOCK_D=self.block_d, BLOCK_DV=self.block_dv, BLOCK_N=self.block_n,
            HAS_WINDOW=self.has_window, QK_FP32=self.qk_fp32, PV_FP32=self.pv_fp32,
        )

    def feature_constexprs(self) -> dict[str, Any]:
        """The soft-capping and sink switches, which only the single-session kernels take (the
        paged ones refuse both)."""
        return dict(SOFTCAP=self.softcap, HAS_SINKS=self.has_sinks)


def split_count(b, hkv: int, programs: int, round_up: bool) -> int:
    """Splits per query tile, so that the ``B * Hkv * splits`` programs of a launch come to
    ``programs`` (the quotient rounded down, or up with ``round_up``), within
    ``[1, _MAX_SPLITS]``. Static, since it sizes the partial buffers: a symbolic batch gets a
    middle value."""
    heads = b * hkv
    if not isinstance(heads, int):
        return _SYMBOLIC_BATCH_SPLITS
    heads = max(1, heads)
    per_head = -(-programs // heads) if round_up else programs // heads
    return max(1, min(_MAX_SPLITS, per_head))


def partial_buffers(
    heads, splits: int, rows: int, block_dv: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial ``(acc, max, sum)`` buffers of a split launch: ``rows`` query rows per
    (``b * Hkv + kv head``, split), fp32, uninitialized (a combine kernel reads only the rows its
    split plan says were written)."""
    part_acc = torch.empty((heads, splits, rows, block_dv), dtype=torch.float32, device=device)
    part_m = torch.empty((heads, splits, rows), dtype=torch.float32, device=device)
    part_l = torch.empty((heads, splits, rows), dtype=torch.float32, device=device)
    return part_acc, part_m, part_l


def attention_output(b, hq, t, v_dim, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The step's output ``[B, Hq, T, Dv]``, laid out token-major (a ``[B, T, Hq, Dv]`` buffer
    seen through ``transpose(1, 2)``): the kernels write it through its strides, and the model's
    ``transpose(1, 2).reshape(B, T, Hq * Dv)`` before its output projection is then a view, so
    Inductor drops the copy it otherwise makes of every multi-token step's output (its
    ``remove_noop_ops`` removes a ``clone`` whose input already has the clone's layout). For
    ``T == 1`` both layouts are the same."""
    return torch.empty((b, t, hq, v_dim), dtype=dtype, device=device).transpose(1, 2)
