"""Triton GEMM for a few rows (``M <= 16``: the sessions method's decode tokens of a batched step,
or one token): ``out = x @ w.T`` for ``x [M, K]`` and a row-major weight ``w [N, K]`` (bf16/fp16,
int8 with a scale per row, or int4 two a byte with a scale and zero per group), the products on
the tensor cores.

Why: at ``2 <= M <= 16`` the batched step's projections are cuBLAS GEMMs (H100, 2026-12-07:
gate|up, down, q|k|v and lm_head at M = 16 read the 1B model's weights at 77% of the copy rate,
64% of the step's kernel time), while at ``M = 1`` the GEMV kernels of ``triton_gemv.py`` reach
85-100%. Their arithmetic is per value on the CUDA cores, which holds at one row but grows with
``M``; here a program holds ``BLOCK_N`` weight rows of a ``BLOCK_K`` chunk, dequantizes them in
registers (int8: the integer, exact in bf16, the row's scale applied to the sum; int4: each value
as the reference rule's ``W'``, ``(q - 8) s + z`` in fp32 rounded to the dtype) and multiplies
the chunk of all ``M`` rows of ``x`` (padded to 16) by it with ``tl.dot``: the weight is read once
whatever ``M``, and the per-value work is the dequantization alone.

int4 has a second form, ``dequant="bits"``: each nibble ``q`` put by integer logic into the
mantissa of the dtype's 1.0 (``1 + q / 16``, exact in bf16, fp16 and fp32: no int-to-float
conversion and no per-value scale), one ``tl.dot`` a group, and the group's scale and zero applied
to the dot's ``[16, BLOCK_N]`` result, ``16 s * dot + (z - 24 s) * sum(x)`` (the decode GEMV's
"bits" algebra, ``triton_gemv._int4_bits_groups``; :func:`_int4_dot_group`, which the decode
GEMV's "mma" kernel calls too): the per-value work is three integer operations.
It differs from the per-value form by fp32's rounding of the sums, not by ``W'``'s rounding.

A launch option for measurement only (``scripts/bench_skinny_gemm.py`` sweeps it against cuBLAS
and tinygemm at the 1B shapes and M = 1-16); no pass emits it and no package contains it. The
first sweep (H100, ``benchmarks/h100-2026-12-07-skinny/``): slower than cuBLAS in bf16 (4% over a
step), 1.31x faster than cuBLAS bf16 in int8 at M = 16 (the weight read once, half the bytes), and
4.5x slower than cuBLAS bf16 in int4 (the per-value unpacking: compiled for sm_90, 255 registers and
64-4,312 bytes of spills a thread; the "bits" form above 100-136 registers and no spill, not yet
measured). Products are accumulated in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from offgraph_export.kernels.triton_base import tl, triton

__all__ = ["MAX_ROWS", "SKINNY_CONFIGS", "int4_dot_block_k", "skinny_gemm"]

#: rows of ``x`` a launch takes (tl.dot's smallest M tile)
MAX_ROWS = 16
#: launches the sweep tries: (BLOCK_N, BLOCK_K, num_warps, num_stages)
SKINNY_CONFIGS = [(16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4), (32, 512, 4, 2), (64, 256, 8, 3), (128, 128, 8, 3)]


@triton.jit
def _one_plus_sixteenths(nibbles, dt: tl.constexpr):
    """``1 + q / 16`` in ``dt`` for int4 values ``q`` (0..15, any integer type), by integer logic:
    ``q`` at the top four mantissa bits below 1.0's (bf16 ``0x3F80``, bits 3..6; fp16 ``0x3C00``,
    bits 6..9; fp32 ``0x3F800000``, bits 19..22), exact in each."""
    if dt == tl.bfloat16:
        return ((nibbles.to(tl.int16) << 3) | 0x3F80).to(tl.bfloat16, bitcast=True)
    elif dt == tl.float16:
        return ((nibbles.to(tl.int16) << 6) | 0x3C00).to(tl.float16, bitcast=True)
    else:
        return ((nibbles.to(tl.int32) << 19) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_dot_group(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, c0, K, x, dt: tl.constexpr, GROUP: tl.constexpr,
                    PRECISION: tl.constexpr):
    """One int4 group (columns ``[c0, c0 + GROUP)``) of the rows at byte offsets ``w_rows`` (scale
    and zero offsets ``s_rows``) against ``x`` (``[16, GROUP]`` in ``dt``), on the tensor cores: the
    dot over ``1 + q / 16`` (:func:`_one_plus_sixteenths`) times ``16 s`` (``[16, BLOCK_N]``) and
    the coefficient of the group's ``sum(x)``, ``z - 24 s`` (``[BLOCK_N]``): ``(q - 8) s + z``
    summed against ``x`` is their sum. Masked past ``K`` (whole groups). The "bits" form here and
    the decode GEMV's "mma" kernel (``triton_gemv._gemv_mma_kernel``)."""
    half = c0 // 2 + tl.arange(0, GROUP // 2)
    b = tl.load(w_ptr + w_rows[:, None] + half[None, :], mask=row_ok[:, None] & (2 * half < K)[None, :], other=0)
    q = tl.interleave(_one_plus_sixteenths(b & 15, dt), _one_plus_sixteenths(b >> 4, dt))
    d = tl.dot(x, tl.trans(q), input_precision=PRECISION)
    group = c0 // GROUP
    gok = row_ok & (group * GROUP + tl.zeros_like(s_rows) < K)
    s = tl.load(s_ptr + s_rows + group, mask=gok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + s_rows + group, mask=gok, other=0.0).to(tl.float32)
    return d * (16.0 * s)[None, :], z - 24.0 * s


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, BITS: tl.constexpr,
):
    """Program p: output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` of all ``M`` rows. QUANT 0
    (float weight), 8 (int8, ``s`` per row) or 4 (int4 ``[N, K / 2]``, the low nibble the even
    column, ``s`` and ``z`` per ``GROUP`` columns). PRECISION: ``tl.dot``'s input precision
    (``ieee`` for fp32 operands, which would otherwise be rounded to tf32). BITS (int4, ``BLOCK_K``
    whole groups): one dot a group over ``1 + q / 16`` (:func:`_one_plus_sixteenths`), the group's
    scale and zero applied to its result."""
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    m = tl.arange(0, 16)
    m_ok = m < M
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = rows.to(tl.int64) * stride_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if BITS:
            for g in tl.static_range(BLOCK_K // GROUP):
                cols = k0 + g * GROUP + tl.arange(0, GROUP)
                col_ok = cols < K  # K is whole groups: a group is in or out
                x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
                d, zc = _int4_dot_group(w_ptr, s_ptr, z_ptr, w_rows, rows.to(tl.int64) * stride_sn, row_ok, k0 + g * GROUP,
                                        K, x.to(dt), dt, GROUP, PRECISION)
                acc += d + tl.sum(x.to(tl.float32), axis=1)[:, None] * zc[None, :]
        else:
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
            if QUANT == 4:
                half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                ok = row_ok[:, None] & (2 * half < K)[None, :]
                b = tl.load(w_ptr + w_rows[:, None] + half[None, :], mask=ok, other=0)
                q = tl.interleave(b & 15, b >> 4).to(tl.float32)
                g = rows.to(tl.int64)[:, None] * stride_sn + (cols // GROUP)[None, :]
                wok = row_ok[:, None] & col_ok[None, :]
                s = tl.load(s_ptr + g, mask=wok, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g, mask=wok, other=0.0).to(tl.float32)
                w = ((q - 8.0) * s + z).to(dt)
            else:
                w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0)
                w = w.to(dt)
            acc = tl.dot(x.to(dt), tl.trans(w), acc, input_precision=PRECISION)
    if QUANT == 8:
        acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + rows[None, :], acc.to(dt), mask=m_ok[:, None] & row_ok[None, :])


def int4_dot_block_k(quant: int, group_size: int, block_k: int, what: str) -> int:
    """The ``BLOCK_K`` a launch of :func:`_int4_dot_group` takes for ``block_k``: at least a group,
    whole groups; refused (``ValueError`` naming ``what``) unless the weight is int4 in groups of a
    power of two of at least 16 values (a ``tl.dot`` and an ``arange`` a group)."""
    if quant != 4 or group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"{what} reads int4 weights in groups of a power of two of at least 16 values, not "
                         f"{'int%d' % quant if quant else 'float'} weights in groups of {group_size}")
    block_k = max(block_k, group_size)
    if block_k % group_size:
        raise ValueError(f"BLOCK_K {block_k} must hold whole groups of {group_size}")
    return block_k


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, scales: Optional[torch.Tensor] = None,
                zeros: Optional[torch.Tensor] = None, group_size: int = 0,
                config: tuple[int, int, int, int] = SKINNY_CONFIGS[1], dequant: str = "value") -> torch.Tensor:
    """``x [M, K] @ W'.T`` in ``x``'s dtype for ``M <= 16``: ``w`` float ``[N, K]``, or quantized as
    ``triton_gemv.gemv_launch`` takes it (int8 ``[N, K]`` with ``scales [N]``; int4 uint8
    ``[N, K / 2]`` with ``scales``/``zeros`` ``[N, K / group_size]``). ``config``: (BLOCK_N,
    BLOCK_K, num_warps, num_stages), one of :data:`SKINNY_CONFIGS` or another; ``dequant``: int4's
    form, ``"value"`` (each value as ``W'`` holds it) or ``"bits"`` (module docstring; groups of a
    multiple of 16 values, ``BLOCK_K`` raised to a group where it is smaller)."""
    quant = 0 if scales is None else (4 if zeros is not None else 8)
    m, k = x.shape
    n = int(w.shape[0])
    if m > MAX_ROWS:
        raise ValueError(f"the skinny GEMM takes at most {MAX_ROWS} rows, not {m}")
    if w.shape[1] * (2 if quant == 4 else 1) != k or w.stride(1) != 1:
        raise ValueError(f"a row-major weight of {k} columns is expected, got {tuple(w.shape)}")
    block_n, block_k, warps, stages = config
    if quant == 4 and (group_size <= 0 or k % group_size or block_k % 2):
        raise ValueError(f"group size {group_size} must divide {k}, and BLOCK_K {block_k} hold whole bytes")
    if dequant not in ("value", "bits"):
        raise ValueError(f"dequant is \"value\" or \"bits\", not {dequant!r}")
    bits = dequant == "bits"
    if bits:
        block_k = int4_dot_block_k(quant, group_size, block_k, 'the "bits" form')
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = scales.contiguous() if scales is not None else x
    z = zeros.contiguous() if zeros is not None else s
    stride_sn = (k // group_size) if quant == 4 else 1
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, s, z, out, m, n, k, x.stride(0), w.stride(0), stride_sn, out.stride(0),
        QUANT=quant, GROUP=max(group_size, 1), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BITS=bits, num_warps=warps,
    )
    return out
