"""What the Triton kernels of the lowered step share: the guarded ``triton`` import, whether kernels
run in the interpreter, the card's SM count, and bulk L2 prefetch.

Why bulk L2 prefetch: a decode step reads every weight and every live K/V row once, so its kernels
are bound by how many bytes each SM keeps in flight. A kernel that loads a block, uses it, then
loads the next keeps only its pipeline's few blocks in flight, and a short kernel spends much of
its time ramping up. ``cp.async.bulk.prefetch.L2`` (sm_90 and later) asks the memory system for a
whole byte range in one instruction, without registers or shared memory to hold it: a program
that knows every row it will read can request them all at once and then read them from L2.

Only a hint: a prefetch never changes a result, so kernels take it as a ``constexpr`` option that
the host turns on only where it compiles (:func:`l2_prefetch_available`), and the interpreter (the
CPU tests) runs the same kernels without it.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "TRITON_IMPORT_ERROR",
    "INTERPRETED",
    "triton",
    "tl",
    "pow2_at_least",
    "sm_count",
    "l2_prefetch_available",
    "prefetch_l2",
    "prefetch_share_l2",
]


def _missing_triton(exc: ImportError):
    """Stand-ins for ``triton``/``triton.language`` when triton is not installed: just enough for
    kernel definitions to be evaluated (never run), so that importing the kernel modules always
    works and only *using* them raises :class:`offgraph_export.errors.ExportError`."""

    class _Triton:
        error = exc

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    class _Language:
        constexpr = object

    return _Triton, _Language


try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _exc:  # pragma: no cover - exercised on machines without triton
    triton, tl = _missing_triton(_exc)
    TRITON_IMPORT_ERROR = _exc


@triton.jit
def _probe():
    pass


#: True when TRITON_INTERPRET=1 made ``triton.jit`` build interpreted kernels (the CPU tests). The
#: interpreter computes bf16 ``tl.dot`` wrongly, so bf16 dots then go through fp32 instead, and
#: it has no inline PTX, so no prefetch.
INTERPRETED = TRITON_IMPORT_ERROR is None and not isinstance(_probe, triton.runtime.jit.JITFunction)

#: Programs the kernels aim for where there is no real GPU to count SMs on (the interpreter, cpu).
_FALLBACK_SMS = 128


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= max(n, floor) (``tl.arange`` and ``tl.dot`` need it)."""
    return max(floor, 1 << max(0, math.ceil(math.log2(n))))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, read at trace time (128 where there is no real
    GPU: the interpreter, cpu)."""
    if device.type == "cuda" and not INTERPRETED:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _FALLBACK_SMS


def l2_prefetch_available(device: torch.device) -> bool:
    """Whether kernels for ``device`` may issue :func:`prefetch_l2` (compiled PTX for sm_90 or
    later; never in the interpreter)."""
    if device.type != "cuda" or INTERPRETED or TRITON_IMPORT_ERROR is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


#: One thread's share of a :func:`prefetch_l2` range: thread ``t`` of the program requests bytes
#: ``[t * piece, (t + 1) * piece)`` of it (threads past the end request nothing), so a range is
#: requested exactly once however the compiler lays out a scalar over threads.
_PREFETCH_PIECE_ASM_TEXT = """{
  .reg .pred p;
  .reg .u32 t, n;
  .reg .u64 o, s, a;
  mov.u32 t, %tid.x;
  cvt.u64.u32 o, t;
  mul.lo.u64 o, o, $2;
  setp.lt.u64 p, o, $3;
  sub.u64 s, $3, o;
  min.u64 s, s, $2;
  cvt.u32.u64 n, s;
  add.u64 a, $1, o;
  @p cp.async.bulk.prefetch.L2.global [a], n;
  mov.u32 $0, 0;
}"""
_PREFETCH_PIECE_ASM = tl.constexpr(_PREFETCH_PIECE_ASM_TEXT) if TRITON_IMPORT_ERROR is None else None


@triton.jit
def prefetch_l2(first, end, PIECES: tl.constexpr):
    """Ask L2 for the bytes from pointer ``first`` up to pointer ``end`` (exclusive; nothing when
    ``end <= first``) as ``PIECES`` bulk requests, one per thread (``PIECES`` at most the
    program's threads).

    ``cp.async.bulk.prefetch.L2`` wants 16-byte-aligned addresses and sizes: the start is rounded
    down (into the same 16 bytes, so into memory the range's own page holds) and the end down, so
    the request never reaches past ``end``; at most 15 trailing bytes go unrequested."""
    lo = first.to(tl.int64)
    hi = end.to(tl.int64)
    lo = lo - lo % 16
    hi = hi - hi % 16
    total = tl.maximum(hi - lo, 0)
    piece = ((total + PIECES - 1) // PIECES + 15) // 16 * 16
    piece = tl.maximum(piece, 16)
    tl.inline_asm_elementwise(
        _PREFETCH_PIECE_ASM, "=r,l,l,l", [lo, piece, total], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def prefetch_share_l2(ptr, numel, pid, programs, PIECES: tl.constexpr):
    """Program ``pid`` of ``programs``: :func:`prefetch_l2` its even share of the ``numel``
    elements at ``ptr`` (another kernel's input: so the next kernel finds it in L2)."""
    share = (numel + programs - 1) // programs
    lo = tl.minimum(pid.to(tl.int64) * share, numel)
    hi = tl.minimum(lo + share, numel)
    prefetch_l2(ptr + lo, ptr + hi, PIECES)
