"""Differences between the torch versions this package runs on (2.11 on the GPU machine, 2.13 in
CI), each an explicit feature check made once at import, never a ``try``/``except TypeError`` around
a call."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch._inductor.config as _inductor_config
from torch.export import Dim, ExportedProgram

__all__ = [
    "AOTI_CHECKS_LOWERBOUND",
    "DIM_HINT_TAKES_RANGE",
    "DECOMPOSES_TRITON_OPS",
    "MODULE_CHECKS_GUARDS",
    "aoti_shim_lacks",
    "dynamic_dim",
    "decompose",
    "unlifted_module",
]


def _accepts(fn: object, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature
        return False


#: ``Dim.DYNAMIC(min=..., max=...)``: range-carrying dynamic-shape hints.
DIM_HINT_TAKES_RANGE: bool = callable(Dim.DYNAMIC) and _accepts(type(Dim.DYNAMIC).__call__, "min")

#: ``ExportedProgram.run_decompositions(decompose_custom_triton_ops=...)``.
DECOMPOSES_TRITON_OPS: bool = _accepts(ExportedProgram.run_decompositions, "decompose_custom_triton_ops")

#: ``torch._inductor.config.aot_inductor.check_lowerbound``: whether a compiled wrapper's input
#: checks include each dynamic dim's lower bound (which AOTInductor puts at 2).
AOTI_CHECKS_LOWERBOUND: bool = hasattr(_inductor_config.aot_inductor, "check_lowerbound")

#: ``ExportedProgram.module(check_guards=...)``: the unlifted module may carry input guard checks.
MODULE_CHECKS_GUARDS: bool = _accepts(ExportedProgram.module, "check_guards")


def unlifted_module(ep: ExportedProgram) -> object:
    """``ep.module()`` without input guard checks, as AOTInductor's own packaging compiles it (the
    runtime checks inputs against the specs itself)."""
    return ep.module(check_guards=False) if MODULE_CHECKS_GUARDS else ep.module()


def dynamic_dim(lo: int, hi: int | None) -> object:
    """A dynamic dimension hint with a range.

    ``Dim.DYNAMIC`` rather than a named strict ``Dim``: masked attention over storage produces
    guards such as ``T*min(16, 32*T) == 16*T`` (from contiguity checks) that hold on the whole
    range but that the strict solver cannot prove (seen on torch 2.11 with CUDA). A hint accepts
    such guards and still fails if the dimension would be specialized to a constant. Without
    range support the hint is unbounded and the ranges are enforced by the runtime's admission.
    """
    if not DIM_HINT_TAKES_RANGE:
        return Dim.DYNAMIC
    return Dim.DYNAMIC(min=lo, max=hi) if hi is not None else Dim.DYNAMIC(min=lo)


def decompose(ep: ExportedProgram, table: "dict | None" = None) -> ExportedProgram:
    """``run_decompositions`` that also decomposes ``triton_op`` custom ops into their kernels
    (where torch can), so AOTInductor compiles the kernels instead of calling the op by name;
    ``table``: further ops to decompose (op overload -> its aten form)."""
    if DECOMPOSES_TRITON_OPS:
        return ep.run_decompositions(dict(table or {}), decompose_custom_triton_ops=True)
    return ep.run_decompositions(dict(table or {}))



def aoti_shim_lacks(device: str, op_names: "list[str]") -> list[str]:
    """Which of the aten ops ``op_names`` (``_grouped_mm``) AOTInductor's C shim for ``device``
    does not declare, so that a package calling them fails to compile (torch 2.11's CUDA shim
    lacks ``_grouped_mm``, which transformers' mixture-of-experts layers call; 2.13's has it).
    Read from the shim header torch ships; none where the header is absent (nothing known)."""
    header = Path(torch.__file__).parent / "include/torch/csrc/inductor/aoti_torch/generated" / f"c_shim_{device}.h"
    if not header.is_file():
        return []
    text = header.read_text(encoding="utf-8", errors="replace")
    return [name for name in op_names if f"aoti_torch_{device}_{name}(" not in text]
