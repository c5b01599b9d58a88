"""What the Triton kernels of the lowered step share: the guarded ``triton`` import, whether kernels
run in the interpreter, the card's SM count and block-size arithmetic.

One module so that each kernel module imports these from below rather than from a sibling.
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
    "wait_for_inputs",
    "pdl_flags",
    "PDL_TRIGGERS",
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


try:  # griddepcontrol (sm_90+): Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older or missing triton: PDL launches are then refused
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """A kernel's first act under programmatic dependent launch (PDL: sm_90+, the launch's
    ``launch_pdl``): with ``PDL == 1`` let the next kernel's programs be scheduled now (they wait in
    turn; with ``PDL == 2`` they are let in only as this kernel's programs exit, the implicit
    trigger), then wait until the kernel before has finished and its writes are visible, before any
    input is read or any output written. ``PDL == 0``, or launched without PDL: nothing (both
    instructions are no-ops then)."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL != 0:
        gdc_wait()


#: Where a PDL kernel lets its dependents be scheduled (:func:`wait_for_inputs`' ``PDL``): at its
#: entry, or as its programs exit.
PDL_TRIGGERS = {"entry": 1, "exit": 2}


def pdl_flags(pdl: object, trigger: object = "entry") -> dict:
    """The launch keywords of a kernel taking :func:`wait_for_inputs`'s ``PDL`` for a launch's
    ``"pdl"`` option: True (compiled in and launched as a programmatic dependent launch, eager
    launches and their CUDA graphs only: AOTInductor's launcher sets no launch attributes),
    ``"code"`` (compiled in, launched plainly: what the instructions cost alone) or False; and its
    ``"pdl_trigger"``, ``"entry"`` or ``"exit"`` (:data:`PDL_TRIGGERS`)."""
    if pdl not in (False, True, "code"):
        raise ValueError(f"a launch's \"pdl\" is True, \"code\" or False, not {pdl!r}")
    if trigger not in PDL_TRIGGERS:
        raise ValueError(f"a launch's \"pdl_trigger\" is \"entry\" or \"exit\", not {trigger!r}")
    if pdl and INTERPRETED:
        raise ValueError("a launch's \"pdl\" needs a GPU (sm_90+); the Triton interpreter has no griddepcontrol")
    if pdl and gdc_wait is None:
        raise ValueError(f"a launch's \"pdl\" needs triton >= 3.3 (triton.language.extra.cuda.gdc_wait); this triton has none")
    return {"PDL": PDL_TRIGGERS[trigger] if pdl else 0, **({"launch_pdl": True} if pdl is True else {})}


#: True when TRITON_INTERPRET=1 made ``triton.jit`` build interpreted kernels (the CPU tests). The
#: interpreter computes bf16 ``tl.dot`` wrongly, so bf16 dots then go through fp32 instead.
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
