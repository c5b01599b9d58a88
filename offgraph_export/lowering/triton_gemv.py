"""Triton GEMV for one-row linears (the decode method's projections): ``out = x @ w.T`` for ``x``
of one row ``[..., K]`` and a row-major weight ``w [N, K]``.

Why: at one token a projection is a matrix-vector product whose cost is reading ``w`` once. A GEMM
template pads the single row to a 16-row tile and gives each program a 32-128-wide column block,
so an output of 2048-3072 features runs on 16-96 programs, fewer than the SMs, far below the
card's bandwidth (measured on the H200, torch 2.11, max-autotune: 0.9-1.2 TB/s for the q/k/v,
output and down projections of a Llama-1B-shaped model). Here each program reads a few full weight
rows in wide contiguous chunks and the grid is sized so every SM has several programs in flight.

One custom op, ``offgraph_lowered::triton_gemv`` (``torch.library.triton_op``), so export keeps one
node and AOTInductor compiles the kernel into the package. Products are accumulated in fp32.
"""

from __future__ import annotations

import torch

from offgraph_export.errors import ExportError
from offgraph_export.lowering.triton_attend import _TRITON_IMPORT_ERROR, tl, triton

__all__ = ["OP_NAME", "triton_gemv", "gemv_applies"]

OP_NAME = "offgraph_lowered::triton_gemv"

#: Outputs wider than this keep the compiler's GEMM (a wide output already spreads over the SMs:
#: the measured 16384- and 128256-wide projections ran at 2.6-4.0 TB/s there).
MAX_GEMV_ROWS = 8192
#: Columns a program reads per loop step (1 KiB of a bf16 row).
_BLOCK_K = 512
#: Programs the grid aims for (several per SM on an H100/H200).
_TARGET_PROGRAMS = 512


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: output features ``[p * BLOCK_N, (p + 1) * BLOCK_N)``, each the dot product of
    one contiguous weight row with ``x``, read ``BLOCK_K`` columns at a time."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(
            w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def _block_n(n: int) -> int:
    """Rows per program: a power of two in [1, 32] giving about :data:`_TARGET_PROGRAMS` programs."""
    block = 1
    while block < 32 and n // (2 * block) >= _TARGET_PROGRAMS:
        block *= 2
    return block


def gemv_applies(x_shape, w_shape) -> bool:
    """Whether a linear of input ``x_shape`` and weight ``w_shape`` is a one-row GEMV this kernel
    takes: static sizes, one row, a 2-D weight of at most :data:`MAX_GEMV_ROWS` rows."""
    sizes = [*x_shape, *w_shape]
    if not all(isinstance(s, int) for s in sizes) or len(w_shape) != 2 or not x_shape:
        return False
    rows = 1
    for s in x_shape[:-1]:
        rows *= s
    return rows == 1 and x_shape[-1] == w_shape[1] and w_shape[0] <= MAX_GEMV_ROWS


def _gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = int(w.shape[0]), int(w.shape[1])
    torch._check(w.stride(1) == 1, lambda: "the weight must be row-major")
    flat = x.reshape(k).contiguous()  # the kernel reads x with unit stride
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    block_n = _block_n(n)
    torch.library.wrap_triton(_gemv_kernel)[(triton.cdiv(n, block_n), 1, 1)](
        flat, w, out, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=_BLOCK_K,
    )
    return out


if _TRITON_IMPORT_ERROR is None:
    _gemv_op = torch.library.triton_op(OP_NAME, mutates_args=())(_gemv)


def triton_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for a one-row ``x`` (:func:`gemv_applies`), through the custom op."""
    if _TRITON_IMPORT_ERROR is not None:
        raise ExportError(f"the GEMV kernel needs the 'triton' package: {_TRITON_IMPORT_ERROR}")
    return _gemv_op(x, w)

