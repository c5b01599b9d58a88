"""Triton GEMV for one-row linears (the decode method's projections): ``out = x @ w.T`` for ``x``
of one row ``[..., K]`` and a row-major weight ``w [N, K]``, with the neighbours a decode layer
puts around it folded in.

Why: at one token a projection is a matrix-vector product whose cost is reading ``w`` once. A GEMM
template pads the single row to a 16-row tile and gives each program a 32-128-wide column block,
so an output of 2048-3072 features runs on 16-96 programs, fewer than the SMs, far below the
card's bandwidth (measured on the H200, torch 2.11, max-autotune: 0.9-1.2 TB/s for the q/k/v,
output and down projections of a Llama-1B-shaped model). Here each program reads 2-4 full weight
rows in wide contiguous chunks, so a 2048-wide output runs on 512-1024 programs (``_gemv_kernel``);
or, for the gated projection, a few programs per SM each walk many one-row tiles with the weight
loads pipelined across tiles (``_gemv_tiles_kernel``), which the sweep in :func:`_config` found
faster there.

At one token the step is also launch-bound: the RMSNorm before a projection, the SiLU·mul after
the gate|up projection and the residual add after the output and down projections are each a
kernel of a few microseconds over a few KiB. The kernel takes them as options:

* ``norm_weight``/``eps`` (prologue): ``x`` is first RMS-normalized, in the rounding order of the
  usual eager RMSNorm (normalize in fp32, round to the output dtype, scale by the weight, round);
* ``gated`` (epilogue): ``w`` holds a gate and an up projection (rows ``gate_offset + r`` and
  ``up_offset + r``); each program reads both and writes ``silu(gate) * up`` (each op rounded as
  eager rounds it), so the 2x-wide projection output never reaches memory;
* ``residual`` (epilogue): ``out + residual``, rounded once.

The weight may also come quantized (design section 11): int8 ``[N, K]`` with a scale per row, or
int4 two a byte ``[N, K / 2]`` with a scale and a zero per ``group_size`` columns, read as stored
(a quarter or half of the bytes). By default the scale and zero are applied once per row (int8:
``s * sum(q x)``) or group (int4: ``s * sum((q - 8) x) + z * sum(x)``), in fp32; per value
(``"dequant": "value"``: each value rounded as ``W'`` holds it) it computes exactly what a float
GEMV over ``W'`` computes, per row or group it differs from that by the rounding of ``W'`` only
(and is faster: fewer operations per value). A third form, ``"dequant": "bits"``, computes what the
per-row-or-group form computes (up to fp32's rounding) without an int-to-float conversion a value
(those run at a quarter of the integer and an eighth of the fp32 multiply-add rate on Hopper; the
H100 int4 kernel reached about 30% of the memory bandwidth): the weight is read as int32 words and
each 4- or 8-bit field is put into the mantissa of a float constant with integer logic
(:func:`_int4_field`, :func:`_int8_field`); a launch option of both kernels. Quantized rows take
the GEMV at any width (no width limit: a quantized lm_head has no compiler GEMM that reads its
stored form). A third kernel, ``"kernel": "mma"`` (int4 only, a launch option for measurement),
multiplies on the tensor cores as tinygemm does at one token: each nibble put into the mantissa of
the dtype's 1.0 (``1 + q / 16``, as the few-row GEMM's "bits" form), one ``tl.dot`` a group against
``x`` padded to 16 rows, the group's scale and zero applied to the dot's result, the folds kept.

One custom op, ``offgraph_lowered::triton_gemv`` (``torch.library.triton_op``), so export keeps one
node and AOTInductor compiles the kernel into the package. Products are accumulated in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from offgraph_export.errors import ExportError
from offgraph_export.kernels.triton_base import (
    TRITON_IMPORT_ERROR as _TRITON_IMPORT_ERROR,
    pow2_at_least as _pow2_at_least,
    pdl_flags,
    sm_count,
    tl,
    triton,
    wait_for_inputs,
)
from offgraph_export.kernels.triton_skinny_gemm import _int4_dot_group, int4_dot_block_k

__all__ = ["OP_NAME", "triton_gemv", "gemv_applies", "MAX_GEMV_ROWS", "MAX_GATED_ROWS"]

OP_NAME = "offgraph_lowered::triton_gemv"

#: Outputs wider than this keep the compiler's GEMM (a wide output already spreads over the SMs:
#: the measured 16384- and 128256-wide projections ran at 2.6-4.0 TB/s there). A gated GEMV
#: reads twice its output width.
MAX_GEMV_ROWS = 8192
#: A gated (gate|up) projection's outputs up to this (it reads twice as many rows): the 8B shape's
#: 14336 fits. Wider than the plain limit because the alternative there is worse: the compiler's
#: GEMM of the 2x-wide weight plus a SiLU·mul kernel, and max-autotune of ``mm(1x4096,
#: 4096x28672)`` was still running after 7 minutes of an 8B export (issue 27); at the 1B shape the
#: gated GEMV ran at cuBLAS's speed with the SiLU·mul kernel saved. Qwen2.5-7B's 18944 fits too.
#: Not yet timed at those shapes.
MAX_GATED_ROWS = 24576
#: Launch configurations, from sweeps on the H200 (``scripts/sweep_decode_kernels.py``, torch
#: 2.11, bf16, projections with their folds, 16 layers' weights in one CUDA graph). Llama-1B
#: (``benchmarks/h200-2026-12-01-host/sweep_gemv.log``): one program per 2 rows x 1024 columns for
#: K = 2048 (q|k|v 6.2 us, output 4.6 us: within 2% of the best of 70 configs each) and 4 x 2048
#: for the K = 8192 down projection (10.6 us, the best); the gated gate|up projection runs the
#: persistent row-tile kernel, 1 row per tile, 4 programs per SM, 3 stages (19.3 us, 3.5 TB/s,
#: against 21.0 us for the per-row-block kernel); 4 warps. Llama-3.1-8B
#: (``benchmarks/h200-2026-12-06-gemv``): the same tile configuration is the best gated one at
#: K = 4096 too (56.8 us, 4.13 TB/s, cuBLAS 56.8 without the folds; the 4 x 2048 rows
#: configuration it had took 123.6 us), and the K = 14336 down projection takes 2 rows x 2048 and
#: 8 warps (30.0 us, 3.91 TB/s, against 39.4 for 4 x 2048 and 4 warps).
_LONG_ROWS = 4096
_VERY_LONG_ROWS = 8192
#: The persistent kernel holds a whole row (and x) in registers; measured at K = 2048 and 4096.
_TILE_MAX_K = 4096
#: Quantized weights (design section 11): dequantized per row (int8) or group (int4), which beat
#: per value on every Llama-1B projection on the H200 (``benchmarks/h200-2026-12-06-gemv``, group
#: 128: int8 step 776 against 1,045 us, int4 1,228 against 1,850); 8 rows x 512 columns for the
#: wide projections (gate|up, lm_head: int8 lm_head 110 us against 151), 4 x 1024 below K = 4096.
_QUANT_WIDE_ROWS = 16384
#: A wide quantized projection that is not gated (the lm_head) with rows up to this many columns
#: takes the persistent row-tile kernel, 4 rows a tile, 4 programs per SM, 3 stages, 4 warps: it
#: prepares x (the norm, int4's even/odd split and group sums) once a program instead of once every
#: 8 rows. Measured on an H100 (``benchmarks/h100-2026-12-07-quantized``, torch 2.11, the 1B
#: lm_head 128256 x 2048 with its norm): int8 115.4 -> 92.6 us, int4 (group 128) 175.3 -> 122.0 us,
#: in the same run as the rows kernel; not measured on an H200 nor at K = 4096 (the 8B lm_head keeps
#: the rows kernel), and the smaller projections keep theirs (mixed there: q|k|v 7-11% faster, the
#: output projection 1-4% either way, down and gate|up slower).
_QUANT_TILE_MAX_K = 2048


# The "bits" form (:func:`_bits_chunk`, no int-to-float conversion a value) where it won, from one
# sweep on an H100 (``benchmarks/h100-2026-12-07-bits``, torch 2.11, the 1B shapes with their folds,
# int4 group 128, us per projection, the default before -> after): the lm_head's tiles launch int4
# 122.7 -> 79.3 (tinygemm 75.4), int8 93.5 -> 91.2; the gated gate|up projection (K <= 2048) on the
# tiles kernel, int4 8 rows 2 programs an SM 8 warps 21.4 -> 17.3, int8 2 rows 4 programs 18.6 ->
# 17.2; int8 rows everywhere else (q|k|v 6.7 -> 6.2, output 4.9 -> 4.7, down at K = 8192 with 8
# warps 10.2 -> 9.0). The int4 rows kernel keeps the per-group form: "bits" there was slower
# (q|k|v 7.8 -> 8.4, down 14.2 -> 14.7: it reads x once a field position a chunk). Not measured on
# an H200 nor at the 8B shapes (K = 4096: the gated and lm_head projections keep the rows kernel).
# int4 then moved to the "bits" form with ``"x": "split"`` (a chunk's x read once and split into the
# words' field positions in registers) everywhere, from the next H100 sweep
# (``benchmarks/h100-2026-12-07-int4-split``, torch 2.11, the same shapes and folds, us, the
# default before -> after): q|k|v rows 4 x 1024 7.98 -> 5.59, output 5.41 -> 4.41, gate|up on the
# rows kernel, 16 rows x 512 columns 17.18 -> 14.26 (the split tiles launch 15.65), down rows 4 x
# 2048 with 8 warps 14.21 -> 9.75 (tinygemm 8.58), the lm_head's tiles launch 80.1 -> 75.9
# (tinygemm 75.9): the step's projections 796 -> ~620 us (tinygemm 617). int8 keeps its launches
# (its split forms were within 3% either way). Not measured on an H200, at the 8B shapes (K = 4096:
# the int4 gate|up and lm_head there take the 16 x 512 rows launch), nor with a bias.
def _config(k: int, gated: bool = False, quantized: int = 0, n: int = 0, bias: bool = False) -> dict:
    """The kernel and its launch parameters for ``n`` weight rows of ``k`` columns: ``kernel``
    "rows" (:func:`_gemv_kernel`: ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``dequant``) or "tiles"
    (:func:`_gemv_tiles_kernel`: ``BLOCK_N``, ``per_sm`` programs, ``num_warps``, ``num_stages``,
    optionally ``dequant``). ``quantized``: the weight's bits, 8 or 4 (0: float), whose launches
    and dequantization forms the sweep in the comment above chose; ``bias``: the linear adds one
    (the rows kernel: the tiles kernel takes one, but its launch was swept without)."""
    if quantized:
        bits = {"dequant": "bits"} if quantized == 8 else {"dequant": "bits", "x": "split"}
        if n >= _QUANT_WIDE_ROWS and k <= _QUANT_TILE_MAX_K and not gated:  # the lm_head
            return {"kernel": "tiles", "BLOCK_N": 4, "per_sm": 4, "num_warps": 4, "num_stages": 3, **bits}
        if quantized == 4:  # the rows kernel, x read once a chunk and split (the int4 sweep below)
            if n >= _QUANT_WIDE_ROWS:
                return {"kernel": "rows", "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, **bits}
            if k >= _LONG_ROWS:
                return {"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 8, **bits}
            return {"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, **bits}
        if n >= _QUANT_WIDE_ROWS and k <= _QUANT_TILE_MAX_K and not bias:  # gate|up
            return {"kernel": "tiles", "BLOCK_N": 2, "per_sm": 4, "num_warps": 4, "num_stages": 3, **bits}
        if n >= _QUANT_WIDE_ROWS:
            return {"kernel": "rows", "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "dequant": "group"}
        if k >= _LONG_ROWS:
            return {"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 8, **bits}
        return {"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, **bits}
    if gated and k <= _TILE_MAX_K and not bias:
        return {"kernel": "tiles", "BLOCK_N": 1, "per_sm": 4, "num_warps": 4, "num_stages": 3}
    return _rows_config(k)


def _rows_config(k: int) -> dict:
    """The per-row-block kernel's float configuration for rows of ``k`` columns."""
    if k > _VERY_LONG_ROWS:
        return {"kernel": "rows", "BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8}
    if k >= _LONG_ROWS:
        return {"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4}
    return {"kernel": "rows", "BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4}


@triton.jit
def _rms_normed(x, scale, rstd, dt: tl.constexpr):
    """RMSNorm of ``x`` given its ``rstd``, in the eager rounding order: normalize in fp32, round
    to ``dt``, scale by the (fp32) weight, round."""
    return (scale * (x.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rstd(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    """The RMSNorm's ``1 / sqrt(mean(x^2) + eps)`` over ``x``'s ``K`` values, ``BLOCK_K`` a step (the
    kernels whose chunks do not hold the whole row)."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        squares += xs * xs
    return tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _x_at(x_ptr, norm_ptr, cols, K, rstd, dt: tl.constexpr, NORM: tl.constexpr):
    """``x`` at ``cols`` (0 past ``K``), RMS-normalized when NORM, as fp32."""
    ok = cols < K
    x = tl.load(x_ptr + cols, mask=ok, other=0.0)
    if NORM:
        scale = tl.load(norm_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = _rms_normed(x, scale, rstd, dt)
    return x.to(tl.float32)


@triton.jit
def _products(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, k0, K, xa, xb, dt: tl.constexpr,
              QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 products of the weight rows at offsets ``w_rows`` (scale rows ``s_rows``) over columns
    ``[k0, k0 + BLOCK_K)`` with ``x``: ``xa`` those columns (int4: the even ones, ``xb`` the odd
    ones). A quantized value is dequantized as the reference rule computes ``W'``: in fp32, then
    rounded to ``dt``."""
    if QUANT == 4:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        even = 2 * half
        ok = row_ok[:, None] & (even < K)[None, :]
        b = tl.load(w_ptr + w_rows[:, None] + half[None, :], mask=ok, other=0)
        g = s_rows[:, None] + (even // GROUP)[None, :]
        s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=ok, other=0.0).to(tl.float32)
        lo = (((b & 15).to(tl.float32) - 8.0) * s + z).to(dt).to(tl.float32)
        hi = (((b >> 4).to(tl.float32) - 8.0) * s + z).to(dt).to(tl.float32)
        return lo * xa[None, :] + hi * xb[None, :]
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=ok, other=0.0)
        if QUANT == 8:
            s = tl.load(s_ptr + s_rows, mask=row_ok, other=0.0).to(tl.float32)
            w = (w.to(tl.float32) * s[:, None]).to(dt)
        return w.to(tl.float32) * xa[None, :]


@triton.jit
def _int4_group_sums(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, k0, K, xa, xb,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 products dequantized per group rather than per value: ``s * sum(q * x) + (z - 8 s) *
    sum(x)`` (``= s * sum((q - 8) x) + z * sum(x)``) over each group of the chunk (``[BLOCK_N,
    BLOCK_K // GROUP]``), the same value as the per-value form up to ``W'``'s rounding to the output
    dtype and fp32's, with a convert and a multiply-add a value and two multiplies a group (the
    ``- 8`` folded into the group's zero term, the ``sum(x)`` shared by the block's rows)."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    even = 2 * half
    ok = row_ok[:, None] & (even < K)[None, :]
    b = tl.load(w_ptr + w_rows[:, None] + half[None, :], mask=ok, other=0)
    p = (b & 15).to(tl.float32) * xa[None, :] + (b >> 4).to(tl.float32) * xb[None, :]
    sums = tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), axis=2)
    xsum = tl.sum(tl.reshape(xa + xb, (BLOCK_K // GROUP, GROUP // 2)), axis=1)
    groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    gok = row_ok[:, None] & (groups * GROUP < K)[None, :]
    s = tl.load(s_ptr + s_rows[:, None] + groups[None, :], mask=gok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + s_rows[:, None] + groups[None, :], mask=gok, other=0.0).to(tl.float32)
    return sums * s + (z - 8.0 * s) * xsum[None, :]


@triton.jit
def _int4_field(words, i: tl.constexpr):
    """Nibble ``i`` (bits ``4i .. 4i + 3``) of each int32 word as the fp32 value ``1 + q / 16``, by
    integer logic only: the nibble moved to bits 19..22 and or-ed into fp32 1.0 (``0x3F800000``,
    whose mantissa bit 19 counts sixteenths). A shift, an and and an or a value where a conversion
    runs at a quarter of their rate; the ``1`` and the ``1 / 16`` are folded into the group's terms
    (:func:`_int4_bits_groups`). The offset 1 is of the size of ``q / 16`` (``128 + q``, at mantissa
    bit 16 of 128.0, needs no shift for one nibble in eight but sums 17x larger terms before the zero
    term cancels them: its error came to 0.82 of the test tolerance against 0.11 here)."""
    if 4 * i <= 19:
        bits = words << (19 - 4 * i)
    else:
        bits = words >> (4 * i - 19)
    return ((bits & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int8_field(words, j: tl.constexpr):
    """Byte ``j`` of each int32 word as the fp32 value of its int8 ``q``, by integer logic and one
    subtraction: the byte xor ``0x4B000080`` is fp32 ``2**23 + 128 + q`` (the sign flip turns
    two's complement into ``q + 128``, and at ``2**23`` the mantissa counts whole units), and
    ``8388736.0 = 2**23 + 128`` is exact, so the difference is ``q`` exactly."""
    field = ((words >> (8 * j)) & 0xFF) ^ 0x4B000080
    return field.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _word_index(k0, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The indexes (in a row) of the int32 words holding columns ``[k0, k0 + BLOCK_K)``: int4
    ``[NG, GW]``, ``NG`` groups of ``GW = GROUP / 8`` words, so that the words are read as a 3-D
    block and the group sums need no reshape; int8 ``[BLOCK_K / 4]``."""
    if QUANT == 4:
        return k0 // 8 + tl.arange(0, BLOCK_K // GROUP)[:, None] * (GROUP // 8) + tl.arange(0, GROUP // 8)[None, :]
    else:
        return k0 // 4 + tl.arange(0, BLOCK_K // 4)


@triton.jit
def _word_block(wp, word_rows, words, row_ok, k0, K, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The int32 words ``words`` (:func:`_word_index`) of the rows at word offsets ``word_rows``,
    0 past ``K``: int4 ``[BLOCK_N, NG, GW]``, int8 ``[BLOCK_N, BLOCK_K / 4]``. The masks are bounds
    the compiler sees are constant over 4 words (int4: whole groups, ``K`` being whole groups;
    int8: ``K / 4`` words, ``K`` a multiple of 16 in its specialization), so a load reads 16 bytes
    (with ``8 * words < K`` the sm_90 PTX read int4 words 8 bytes a load and int8 words 4)."""
    if QUANT == 4:
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        ok = row_ok[:, None, None] & (groups < K // GROUP)[None, :, None]
        return tl.load(wp + word_rows[:, None, None] + words[None, :, :], mask=ok, other=0)
    else:
        ok = row_ok[:, None] & (words < K // 4)[None, :]
        return tl.load(wp + word_rows[:, None] + words[None, :], mask=ok, other=0)


@triton.jit
def _x_fields(x_ptr, norm_ptr, words, K, rstd, dt: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr):
    """``x`` (:func:`_x_at`) at each field position of the int32 words ``words``
    (:func:`_word_index`): a tuple of 8 (int4: columns ``8 word + i``) or 4 (int8: ``4 word + j``)
    fp32 tensors of ``words``' shape, field ``i`` of a word to be multiplied by the ``i``-th."""
    FIELDS: tl.constexpr = 8 if QUANT == 4 else 4
    xs = ()
    for i in tl.static_range(FIELDS):
        xs = xs + (_x_at(x_ptr, norm_ptr, FIELDS * words + i, K, rstd, dt, NORM),)
    return xs


@triton.jit
def _x_split(xf, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """What :func:`_x_fields` returns, from ``xf``, the chunk's ``BLOCK_K`` contiguous columns of
    ``x`` already read (and normalized) as fp32: the columns reshaped to the words' index shape
    (:func:`_word_index`) with a last axis of the word's fields, which ``tl.split`` halves three
    times (int4; twice for int8) into one tensor a field, in registers, where :func:`_x_fields`
    reads ``x`` (and the norm's weight) from memory again at a stride of 8 (4) for each field. The
    same values, so the same sums; the launch option ``"x": "split"``, for measurement."""
    if QUANT == 4:
        # column 8 w + i, i = 4 i2 + 2 i1 + i0, w = g GW + j: [NG, GW, i2, i1, i0]
        even, odd = tl.split(tl.reshape(xf, (BLOCK_K // GROUP, GROUP // 8, 2, 2, 2)))
        f04, f26 = tl.split(even)
        f15, f37 = tl.split(odd)
        f0, f4 = tl.split(f04)
        f2, f6 = tl.split(f26)
        f1, f5 = tl.split(f15)
        f3, f7 = tl.split(f37)
        return (f0, f1, f2, f3, f4, f5, f6, f7)
    else:
        # column 4 w + j, j = 2 j1 + j0: [BLOCK_K / 4, j1, j0]
        even, odd = tl.split(tl.reshape(xf, (BLOCK_K // 4, 2, 2)))
        f0, f2 = tl.split(even)
        f1, f3 = tl.split(odd)
        return (f0, f1, f2, f3)


@triton.jit
def _int4_bits_groups(p, xg, s_ptr, z_ptr, s_rows, row_ok, k0, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The chunk's per-group contributions ``[BLOCK_N, NG]`` from ``p`` (``(1 + q / 16) * x``
    ``[BLOCK_N, NG, GW]``) and ``xg`` (each group's ``sum(x)``, ``[NG]``): ``(q - 8) s + z``
    summed against ``x`` is ``16 s * sum((1 + q / 16) x) + (z - 24 s) * sum(x)``. Both kernels'
    "bits" form (:func:`_bits_chunk`, :func:`_tile_sums`)."""
    groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    gok = row_ok[:, None] & (groups * GROUP < K)[None, :]
    s = tl.load(s_ptr + s_rows[:, None] + groups[None, :], mask=gok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + s_rows[:, None] + groups[None, :], mask=gok, other=0.0).to(tl.float32)
    return tl.sum(p, axis=2) * (16.0 * s) + (z - 24.0 * s) * xg[None, :]


@triton.jit
def _bits_chunk(w_ptr, s_ptr, z_ptr, x_ptr, norm_ptr, gate_rows, up_rows, stride_wn, stride_sn, row_ok, k0, K, rstd,
                dt: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_SPLIT: tl.constexpr):
    """One chunk's contribution to the accumulators of the gate rows and (GATED) the up rows, the
    ``"bits"`` form: the rows read as int32 words (``stride_wn`` in words), each
    field turned into fp32 by :func:`_int4_field` / :func:`_int8_field` and multiplied by ``x`` at
    its column, fp32 throughout. ``x`` is read once a field position (column ``8 word + i`` for
    int4, ``4 word + j`` for int8) and shared by both row sets. int4: per-group contributions
    ``[BLOCK_N, NG]`` (:func:`_int4_bits_groups`); int8: the products before their row's scale
    ``[BLOCK_N, BLOCK_K / 4]``, as the per-row form accumulates them. X_SPLIT: the chunk's ``x``
    read once, contiguously, and split into its field positions (:func:`_x_split`). Returns
    (gate, up); up is gate unless GATED."""
    wp = w_ptr.to(tl.pointer_type(tl.int32))
    words = _word_index(k0, QUANT, GROUP, BLOCK_K)
    if X_SPLIT:
        xs = _x_split(_x_at(x_ptr, norm_ptr, k0 + tl.arange(0, BLOCK_K), K, rstd, dt, NORM), QUANT, GROUP, BLOCK_K)
    gate_words = _word_block(wp, gate_rows * stride_wn, words, row_ok, k0, K, QUANT, GROUP, BLOCK_K)
    up_words = gate_words
    if GATED:
        up_words = _word_block(wp, up_rows * stride_wn, words, row_ok, k0, K, QUANT, GROUP, BLOCK_K)
    if QUANT == 4:
        p = tl.zeros([BLOCK_N, BLOCK_K // GROUP, GROUP // 8], dtype=tl.float32)
        p_up = p
        xsum = tl.zeros([BLOCK_K // GROUP, GROUP // 8], dtype=tl.float32)
        for i in tl.static_range(8):
            if X_SPLIT:
                x = xs[i]
            else:
                x = _x_at(x_ptr, norm_ptr, 8 * words + i, K, rstd, dt, NORM)
            p += _int4_field(gate_words, i) * x[None, :, :]
            if GATED:
                p_up += _int4_field(up_words, i) * x[None, :, :]
            xsum += x
        xg = tl.sum(xsum, axis=1)
        gate = _int4_bits_groups(p, xg, s_ptr, z_ptr, gate_rows * stride_sn, row_ok, k0, K, GROUP, BLOCK_K)
        up = gate
        if GATED:
            up = _int4_bits_groups(p_up, xg, s_ptr, z_ptr, up_rows * stride_sn, row_ok, k0, K, GROUP, BLOCK_K)
        return gate, up
    else:
        p = tl.zeros([BLOCK_N, BLOCK_K // 4], dtype=tl.float32)
        p_up = p
        for j in tl.static_range(4):
            if X_SPLIT:
                x = xs[j]
            else:
                x = _x_at(x_ptr, norm_ptr, 4 * words + j, K, rstd, dt, NORM)
            p += _int8_field(gate_words, j) * x[None, :]
            if GATED:
                p_up += _int8_field(up_words, j) * x[None, :]
        return p, p_up


@triton.jit
def _chunk(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, k0, K, xa, xb, dt: tl.constexpr, QUANT: tl.constexpr,
           GROUP: tl.constexpr, BY_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One chunk's contribution to the accumulator: per value (:func:`_products`), or with
    BY_GROUP the int8 products before their row's scale (applied once to the row's sum) and the
    int4 per-group sums (:func:`_int4_group_sums`)."""
    if BY_GROUP and QUANT == 4:
        return _int4_group_sums(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, k0, K, xa, xb, GROUP, BLOCK_N, BLOCK_K)
    elif BY_GROUP and QUANT == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols < K)[None, :]
        q = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=ok, other=0)
        return q.to(tl.float32) * xa[None, :]
    else:
        return _products(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, k0, K, xa, xb, dt, QUANT, GROUP, BLOCK_K)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, s_ptr, z_ptr, b_ptr, N, K, stride_wn, stride_sn, gate_offset, up_offset, eps,
    NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    BIAS: tl.constexpr, BY_GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC_K: tl.constexpr, X_SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Program p: output features ``[p * BLOCK_N, (p + 1) * BLOCK_N)``, each the dot product of
    one contiguous weight row (two when GATED) with ``x``, read ``BLOCK_K`` columns at a time
    (QUANT 8 or 4: a quantized row, dequantized in registers; ``ACC_K`` the products' width, half
    ``BLOCK_K`` for int4, whose even and odd columns are summed apart, or its groups a chunk by
    group). BY_GROUP: scales applied per row or group; with BITS too, the rows read as int32 words
    and converted by bit logic (:func:`_bits_chunk`; ``stride_wn`` in words, given so from the host
    so that its specialization as a multiple of 16 tells the compiler the rows' word loads are
    aligned; ``ACC_K`` the chunk's groups for int4, its words for int8). X_SPLIT: a chunk's ``x``
    read once, contiguously, and split in registers (into the words' field positions with BITS,
    else int4's even and odd columns). Every intermediate an eager decode layer would store is rounded to the output
    dtype here. BIAS: the linear's bias joins the fp32 sum before its rounding, as a GEMM's bias
    epilogue adds it. PDL (all three kernels): :func:`~offgraph_export.kernels.triton_base.wait_for_inputs` first."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rstd = 0.0
    if NORM:
        rstd = _rstd(x_ptr, K, eps, BLOCK_K)
    acc = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
    gate_rows = (rows + gate_offset).to(tl.int64)
    up_rows = (rows + up_offset).to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        if BITS:
            gate, up = _bits_chunk(w_ptr, s_ptr, z_ptr, x_ptr, norm_ptr, gate_rows, up_rows, stride_wn, stride_sn, row_ok,
                                   k0, K, rstd, dt, NORM, GATED, QUANT, GROUP, BLOCK_N, BLOCK_K, X_SPLIT)
            acc += gate
            if GATED:
                acc_up += up
        else:
            if QUANT == 4 and X_SPLIT:  # read once, split into the even and odd columns in registers
                xa, xb = tl.split(tl.reshape(_x_at(x_ptr, norm_ptr, k0 + tl.arange(0, BLOCK_K), K, rstd, dt, NORM),
                                             (BLOCK_K // 2, 2)))
            elif QUANT == 4:
                even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                xa = _x_at(x_ptr, norm_ptr, even, K, rstd, dt, NORM)
                xb = _x_at(x_ptr, norm_ptr, even + 1, K, rstd, dt, NORM)
            else:
                xa = _x_at(x_ptr, norm_ptr, k0 + tl.arange(0, BLOCK_K), K, rstd, dt, NORM)
                xb = xa
            acc += _chunk(w_ptr, s_ptr, z_ptr, gate_rows * stride_wn, gate_rows * stride_sn, row_ok, k0, K, xa, xb,
                          dt, QUANT, GROUP, BY_GROUP, BLOCK_N, BLOCK_K)
            if GATED:
                acc_up += _chunk(w_ptr, s_ptr, z_ptr, up_rows * stride_wn, up_rows * stride_sn, row_ok, k0, K, xa, xb,
                                 dt, QUANT, GROUP, BY_GROUP, BLOCK_N, BLOCK_K)
    proj = tl.sum(acc, axis=1)
    if BY_GROUP and QUANT == 8:  # the row's scale, once
        proj = proj * tl.load(s_ptr + gate_rows, mask=row_ok, other=0.0).to(tl.float32)
    if BIAS:
        proj += tl.load(b_ptr + gate_rows, mask=row_ok, other=0.0).to(tl.float32)
    up = proj
    if GATED:
        up = tl.sum(acc_up, axis=1)
        if BY_GROUP and QUANT == 8:
            up = up * tl.load(s_ptr + up_rows, mask=row_ok, other=0.0).to(tl.float32)
        if BIAS:
            up += tl.load(b_ptr + up_rows, mask=row_ok, other=0.0).to(tl.float32)
    _finish(proj, up, out_ptr, res_ptr, rows, row_ok, GATED, RESIDUAL)


@triton.jit
def _finish(proj, up, out_ptr, res_ptr, rows, row_ok, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue of both kernels: the fp32 row sums ``proj`` (and ``up`` when GATED) rounded as
    eager stores them, then ``silu(gate) * up`` and the residual add, each rounded, and the store."""
    dt = out_ptr.dtype.element_ty
    out = proj.to(dt)  # the projection's output, rounded as eager stores it
    if GATED:
        gate = out.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)
        out = (act.to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)
    if RESIDUAL:
        res = tl.load(res_ptr + rows, mask=row_ok, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(out_ptr + rows, out, mask=row_ok)


@triton.jit
def _tile_sums(w_ptr, s_ptr, z_ptr, w_rows, s_rows, row_ok, cols, col_ok, xf, xa, xb, xsum, xs, K,
               QUANT: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """fp32 row sums of one row tile against the whole (prepared) ``x``: float rows against
    ``xf``; int8 rows ``s * sum(q x)``; int4 rows by group, ``s * sum(q x) + (z - 8 s) * sum(x)``
    over ``xa``/``xb`` (the even and odd columns) and ``xsum`` (each group's ``sum(x)``), as
    :func:`_int4_group_sums` computes them. BITS: the rows read as int32 words (``w_rows`` in
    words), int4 ``[BLOCK_N, NG, GW]``, int8 ``[BLOCK_N, BLOCK_K / 4]`` (:func:`_word_block`), each
    field turned into fp32 by :func:`_int4_field` / :func:`_int8_field` and multiplied by its ``x``
    from ``xs`` (:func:`_x_fields`); int4 groups as :func:`_int4_bits_groups` (``xsum`` ``[NG]``),
    int8 the row's scale once."""
    if BITS:
        words = _word_index(0, QUANT, GROUP, BLOCK_K)
        w = _word_block(w_ptr.to(tl.pointer_type(tl.int32)), w_rows, words, row_ok, 0, K, QUANT, GROUP, BLOCK_K)
        if QUANT == 4:
            p = _int4_field(w, 0) * xs[0][None, :, :]
            for i in tl.static_range(1, 8):
                p += _int4_field(w, i) * xs[i][None, :, :]
            return tl.sum(_int4_bits_groups(p, xsum, s_ptr, z_ptr, s_rows, row_ok, 0, K, GROUP, BLOCK_K), axis=1)
        else:
            p = _int8_field(w, 0) * xs[0][None, :]
            for j in tl.static_range(1, 4):
                p += _int8_field(w, j) * xs[j][None, :]
            return tl.sum(p, axis=1) * tl.load(s_ptr + s_rows, mask=row_ok, other=0.0).to(tl.float32)
    elif QUANT == 4:
        half = tl.arange(0, BLOCK_K // 2)
        ok = row_ok[:, None] & (2 * half < K)[None, :]
        b = tl.load(w_ptr + w_rows[:, None] + half[None, :], mask=ok, other=0)
        p = (b & 15).to(tl.float32) * xa[None, :] + (b >> 4).to(tl.float32) * xb[None, :]
        sums = tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), axis=2)
        groups = tl.arange(0, BLOCK_K // GROUP)
        gok = row_ok[:, None] & (groups * GROUP < K)[None, :]
        s = tl.load(s_ptr + s_rows[:, None] + groups[None, :], mask=gok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + s_rows[:, None] + groups[None, :], mask=gok, other=0.0).to(tl.float32)
        return tl.sum(sums * s + (z - 8.0 * s) * xsum[None, :], axis=1)
    else:
        mask = row_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        out = tl.sum(w.to(tl.float32) * xf, axis=1)
        if QUANT == 8:
            out = out * tl.load(s_ptr + s_rows, mask=row_ok, other=0.0).to(tl.float32)
        return out


@triton.jit
def _gemv_tiles_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, s_ptr, z_ptr, b_ptr, N, K, stride_wn, stride_sn, gate_offset, up_offset, eps,
    NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    BIAS: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    X_SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """Persistent variant for rows that fit one block (``K <= BLOCK_K``): program p prepares
    ``x`` once (the RMSNorm prologue included), then walks the row tiles ``p, p + P, ...`` (P
    programs, a few per SM), ``BLOCK_N`` output features (weight rows) each, with the weight loads
    software-pipelined ``NUM_STAGES`` deep across tiles, so an SM keeps reading weights while it
    reduces the tile before, instead of starting a new program (and its prologue) per tile.
    QUANT 8 or 4: quantized rows dequantized per row or group (:func:`_tile_sums`); ``x`` and,
    for int4, its even and odd columns and each group's sum are prepared once a program, where
    the per-row-block kernel reads them again for every few rows. BITS: the rows read as int32
    words (``stride_wn`` in words) and converted by bit logic, against ``x`` at each field
    position (:func:`_x_fields`, or with X_SPLIT the ``x`` read above split in registers:
    :func:`_x_split`) and, for int4, each group's sum, prepared once a program too. BIAS as there."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dt = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    rstd = 0.0
    if NORM:
        squares = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(squares * squares, axis=0) / K + eps)
        scale = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = _rms_normed(x, scale, rstd, dt)
    xf = x.to(tl.float32)[None, :]
    xa = xf
    xb = xf
    xsum = xf
    xs = xf
    if BITS:
        if X_SPLIT:  # the x read above, split in registers
            xs = _x_split(x.to(tl.float32), QUANT, GROUP, BLOCK_K)
        else:
            xs = _x_fields(x_ptr, norm_ptr, _word_index(0, QUANT, GROUP, BLOCK_K), K, rstd, dt, NORM, QUANT)
        if QUANT == 4:
            xsum = xs[0]
            for i in tl.static_range(1, 8):
                xsum += xs[i]
            xsum = tl.sum(xsum, axis=1)
    elif QUANT == 4:
        xa, xb = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_K // 2, 2)))
        xsum = tl.sum(tl.reshape(xa + xb, (BLOCK_K // GROUP, GROUP // 2)), axis=1)
    for tile in tl.range(pid, tl.cdiv(N, BLOCK_N), programs, num_stages=NUM_STAGES):
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        gate_rows = (rows + gate_offset).to(tl.int64)
        proj = _tile_sums(w_ptr, s_ptr, z_ptr, gate_rows * stride_wn, gate_rows * stride_sn, row_ok, cols, col_ok, xf,
                          xa, xb, xsum, xs, K, QUANT, GROUP, BITS, BLOCK_N, BLOCK_K)
        if BIAS:
            proj += tl.load(b_ptr + gate_rows, mask=row_ok, other=0.0).to(tl.float32)
        up = proj
        if GATED:
            up_rows = (rows + up_offset).to(tl.int64)
            up = _tile_sums(w_ptr, s_ptr, z_ptr, up_rows * stride_wn, up_rows * stride_sn, row_ok, cols, col_ok, xf,
                            xa, xb, xsum, xs, K, QUANT, GROUP, BITS, BLOCK_N, BLOCK_K)
            if BIAS:
                up += tl.load(b_ptr + up_rows, mask=row_ok, other=0.0).to(tl.float32)
        _finish(proj, up, out_ptr, res_ptr, rows, row_ok, GATED, RESIDUAL)


@triton.jit
def _gemv_mma_kernel(
    x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, s_ptr, z_ptr, b_ptr, N, K, stride_wn, stride_sn, gate_offset, up_offset, eps,
    NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, GROUP: tl.constexpr, BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Program p: output features ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` over int4 rows (``[N, K / 2]``,
    a scale and a zero per ``GROUP`` columns), on the tensor cores: ``x`` (RMS-normalized when
    NORM, rounded as the other kernels round it) padded to a 16-row tile whose other rows are 0,
    ``BLOCK_K`` columns (whole groups) a step, one dot a group (``triton_skinny_gemm._int4_dot_group``).
    The epilogue and BIAS as the other kernels'."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rstd = 0.0
    if NORM:
        rstd = _rstd(x_ptr, K, eps, BLOCK_K)
    first = tl.arange(0, 16) == 0
    gate_rows = (rows + gate_offset).to(tl.int64)
    up_rows = (rows + up_offset).to(tl.int64)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        acc_up_z = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        for g in tl.static_range(BLOCK_K // GROUP):
            c0 = k0 + g * GROUP
            xg = _x_at(x_ptr, norm_ptr, c0 + tl.arange(0, GROUP), K, rstd, dt, NORM)
            x16 = tl.where(first[:, None], xg[None, :], 0.0).to(dt)
            xsum = tl.sum(xg, axis=0)
            d, zc = _int4_dot_group(w_ptr, s_ptr, z_ptr, gate_rows * stride_wn, gate_rows * stride_sn, row_ok, c0, K, x16,
                                    dt, GROUP, PRECISION)
            acc += d
            acc_z += xsum * zc
            if GATED:
                d, zc = _int4_dot_group(w_ptr, s_ptr, z_ptr, up_rows * stride_wn, up_rows * stride_sn, row_ok, c0, K, x16,
                                        dt, GROUP, PRECISION)
                acc_up += d
                acc_up_z += xsum * zc
    proj = tl.sum(tl.where(first[:, None], acc, 0.0), axis=0) + acc_z
    if BIAS:
        proj += tl.load(b_ptr + gate_rows, mask=row_ok, other=0.0).to(tl.float32)
    up = proj
    if GATED:
        up = tl.sum(tl.where(first[:, None], acc_up, 0.0), axis=0) + acc_up_z
        if BIAS:
            up += tl.load(b_ptr + up_rows, mask=row_ok, other=0.0).to(tl.float32)
    _finish(proj, up, out_ptr, res_ptr, rows, row_ok, GATED, RESIDUAL)


def gemv_applies(x_shape, w_shape, gated: bool = False, quantized: bool = False) -> bool:
    """Whether a linear of input ``x_shape`` and (float, dequantized) weight ``w_shape`` is a
    one-row GEMV this kernel takes: static sizes, one row, a 2-D weight of at most
    :data:`MAX_GEMV_ROWS` output rows (``gated``: twice at most :data:`MAX_GATED_ROWS`, half of
    them gate rows, an even count; ``quantized``: any number)."""
    sizes = [*x_shape, *w_shape]
    if not all(isinstance(s, int) for s in sizes) or len(w_shape) != 2 or not x_shape:
        return False
    rows = 1
    for s in x_shape[:-1]:
        rows *= s
    outputs = w_shape[0] // 2 if gated else w_shape[0]
    if gated and w_shape[0] % 2:
        return False
    limit = MAX_GATED_ROWS if gated else MAX_GEMV_ROWS
    return rows == 1 and x_shape[-1] == w_shape[1] and 0 < outputs and (quantized or outputs <= limit)


def _gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    gated: bool = False,
    gate_first: bool = True,
    scales: Optional[torch.Tensor] = None,
    zeros: Optional[torch.Tensor] = None,
    group_size: int = 0,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return gemv_launch(x, w, norm_weight, eps, residual, gated, gate_first, scales=scales, zeros=zeros,
                       group_size=group_size, bias=bias)


def _dequant_form(config: dict, quant: int, w: torch.Tensor, k: int, group_size: int) -> str:
    """The dequantization form for ``config`` ("value", "group" or "bits"; float weights:
    "value"; the tiles kernel reads per row or group unless "bits"): "bits" reads the weight as
    int32 words, so it falls back to "group" unless a row is whole, 4-byte-aligned words (int4:
    ``k % 8 == 0``, int8: ``k % 4 == 0``; the row stride and the weight's offset multiples of 4
    bytes) and, for int4, a group is whole words (``group_size % 8 == 0``)."""
    form = config.get("dequant", "value") if quant else "value"
    if form == "bits":
        words = k % (8 if quant == 4 else 4) == 0 and (quant == 8 or group_size % 8 == 0)
        if not (words and w.stride(0) % 4 == 0 and w.storage_offset() % 4 == 0):
            return "group"
    return form


def gemv_launch(x, w, norm_weight=None, eps=0.0, residual=None, gated=False, gate_first=True,
                config: Optional[dict] = None, scales=None, zeros=None, group_size: int = 0, bias=None) -> torch.Tensor:
    """The op's body; ``config`` overrides :func:`_config` (``scripts/sweep_decode_kernels.py``
    calls this eagerly to sweep launch configurations). Its ``"dequant"`` picks the dequantization
    of a quantized weight: ``"group"`` (the default's) applies the scale once per row (int8) or
    group (int4); ``"value"`` (the rows kernel; the tiles kernel reads by group then) dequantizes
    each value as ``W'`` holds it (:func:`_chunk`); ``"bits"`` (both kernels) computes what
    ``"group"`` computes, differing from it by fp32's rounding only, without an int-to-float
    conversion a value: the weight is read as int32 words and each field put into the mantissa of
    an fp32 constant by integer logic (int4: ``1 + q / 16``, the offset and the scale folded into
    the group's terms; int8: ``2**23 + 128 + q``, less ``2**23 + 128``), :func:`_bits_chunk`,
    :func:`_tile_sums`. "bits" falls back to "group" where a row is not whole, aligned int32
    words (:func:`_dequant_form`: int4 ``K % 8``, int8 ``K % 4``, the row stride or offset not a
    multiple of 4 bytes) or an int4 group is not (``group_size % 8``); with it, ``"x": "split"``
    reads a chunk's ``x`` once and splits it into the words' field positions in registers
    (:func:`_x_split`) instead of reading it again at each (the same sums); so too the rows
    kernel's int4 per-group and per-value forms, into the even and odd columns. ``"pdl"``: a
    programmatic dependent launch (:func:`~offgraph_export.kernels.triton_base.pdl_flags`, with
    ``"pdl_trigger"``; ``scripts/bench_pdl.py``). With ``scales`` the weight
    is quantized (design section 11): int8 ``[N, K]`` and scales ``[N]``, or with ``zeros`` and
    ``group_size`` int4 ``[N, K / 2]`` and scales and zeros ``[N, K / group_size]``. ``bias``:
    ``[N]``, the linear's (Qwen-style q/k/v projections)."""
    quant = 0 if scales is None else (4 if zeros is not None else 8)
    n, k = int(w.shape[0]), int(x.shape[-1])
    torch._check(w.stride(1) == 1, lambda: "the weight must be row-major")
    torch._check(w.shape[1] * (2 if quant == 4 else 1) == k, lambda: f"x has {k} features, the weight {w.shape[1]}")
    stride_sn = 0
    if quant:
        torch._check(w.dtype == (torch.uint8 if quant == 4 else torch.int8), lambda: f"an int{quant} weight is stored as {w.dtype}")
        groups = k // group_size if quant == 4 else 1
        torch._check(quant == 8 or (group_size > 0 and k % group_size == 0), lambda: f"group size {group_size} must divide {k}")
        torch._check(scales.numel() == n * groups, lambda: f"scales must hold {n} x {groups} values")
        torch._check(zeros is None or zeros.numel() == n * groups, lambda: f"zeros must hold {n} x {groups} values")
        scales = scales.contiguous()
        zeros = zeros.contiguous() if zeros is not None else scales
        stride_sn = groups
    out_dtype = scales.dtype if quant else w.dtype
    n_out = n // 2 if gated else n
    flat = x.reshape(k).contiguous()  # the kernel reads x with unit stride
    out = torch.empty((*x.shape[:-1], n_out), dtype=out_dtype, device=x.device)
    norm = flat
    if norm_weight is not None:
        torch._check(norm_weight.shape == (k,), lambda: f"the norm weight must have shape ({k},)")
        norm = norm_weight.contiguous()
    res = out
    if residual is not None:
        torch._check(residual.numel() == n_out, lambda: f"the residual must have {n_out} elements")
        res = residual.reshape(n_out).contiguous()
    gate_offset, up_offset = (0, n_out) if gate_first else (n_out, 0)
    if not gated:
        gate_offset = up_offset = 0
    if bias is not None:
        torch._check(bias.shape == (n,), lambda: f"the bias must have shape ({n},)")
        bias = bias.contiguous()
    if config is None:
        config = _config(k, gated, quant, n, bias is not None)
    if config.get("x", "fields") not in ("fields", "split"):
        raise ValueError(f"a launch's \"x\" is \"fields\" or \"split\", not {config['x']!r}")
    flags = dict(NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None,
                 BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"], **pdl_flags(config.get("pdl", False), config.get("pdl_trigger", "entry")))
    tiles = triton.cdiv(n_out, config["BLOCK_N"])
    s_arg = scales if quant else flat
    z_arg = zeros if quant else flat
    b_arg = bias if bias is not None else flat
    if config["kernel"] == "mma":
        block_k = int4_dot_block_k(quant, group_size, config["BLOCK_K"], 'the "mma" kernel')
        args = (flat, w, out, norm, res, s_arg, z_arg, b_arg, n_out, k, w.stride(0), stride_sn, gate_offset, up_offset, eps)
        torch.library.wrap_triton(_gemv_mma_kernel)[(tiles, 1, 1)](
            *args, GROUP=group_size, BIAS=bias is not None, BLOCK_K=block_k, NUM_STAGES=config.get("num_stages", 2),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **flags,
        )
    elif config["kernel"] == "tiles":
        torch._check(quant != 4 or group_size % 2 == 0, lambda: f"an int4 group holds whole bytes, not {group_size} values")
        programs = min(tiles, config["per_sm"] * sm_count(x.device))
        bits = _dequant_form(config, quant, w, k, group_size) == "bits"
        stride_wn = w.stride(0) // 4 if bits else w.stride(0)  # bits: in int32 words
        args = (flat, w, out, norm, res, s_arg, z_arg, b_arg, n_out, k, stride_wn, stride_sn, gate_offset, up_offset, eps)
        torch.library.wrap_triton(_gemv_tiles_kernel)[(programs, 1, 1)](
            *args, QUANT=quant, GROUP=max(group_size, 1), BIAS=bias is not None, BITS=bits,
            BLOCK_K=max(_pow2_at_least(k), 2 * max(group_size, 1)), NUM_STAGES=config["num_stages"],
            X_SPLIT=bits and config.get("x", "fields") == "split", **flags,
        )
    else:
        block_k = config["BLOCK_K"]
        if quant == 4:
            block_k = max(block_k, 2 * group_size)  # a chunk holds whole groups' worth of columns
        form = _dequant_form(config, quant, w, k, group_size)
        by_group, bits = form in ("group", "bits"), form == "bits"
        if by_group and quant == 4:
            acc_k = block_k // group_size
        else:
            acc_k = block_k // 4 if bits else block_k // 2 if quant == 4 else block_k
        stride_wn = w.stride(0) // 4 if bits else w.stride(0)  # bits: in int32 words
        args = (flat, w, out, norm, res, s_arg, z_arg, b_arg, n_out, k, stride_wn, stride_sn, gate_offset, up_offset, eps)
        torch.library.wrap_triton(_gemv_kernel)[(tiles, 1, 1)](
            *args, QUANT=quant, GROUP=max(group_size, 1), BIAS=bias is not None, BY_GROUP=by_group, BITS=bits,
            BLOCK_K=block_k, ACC_K=acc_k, X_SPLIT=(bits or quant == 4) and config.get("x", "fields") == "split", **flags,
        )
    return out


if _TRITON_IMPORT_ERROR is None:
    _gemv_op = torch.library.triton_op(OP_NAME, mutates_args=())(_gemv)


def triton_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    gated: bool = False,
    gate_first: bool = True,
    scales: Optional[torch.Tensor] = None,
    zeros: Optional[torch.Tensor] = None,
    group_size: int = 0,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ w.T`` (``+ bias``) for a one-row ``x`` (:func:`gemv_applies`), through the custom op, with the
    optional RMSNorm prologue, gated (``silu(gate) * up``) epilogue and residual add described in
    the module docstring. ``gate_first``: the gate rows are the first half of ``w``. ``scales``
    (``zeros``, ``group_size``): ``w`` is quantized (:func:`gemv_launch`); ``bias``: the linear's."""
    if _TRITON_IMPORT_ERROR is not None:
        raise ExportError(f"the GEMV kernel needs the 'triton' package: {_TRITON_IMPORT_ERROR}")
    return _gemv_op(x, w, norm_weight, eps, residual, gated, gate_first, scales, zeros, group_size, bias)
