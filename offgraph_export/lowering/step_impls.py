"""The registry of lowered step implementations: the code the strip pass puts where the neutral op
was. Each has the signature of :func:`~offgraph_export.lowering.portable.portable_update_and_attend`
``(q, k, v, position, k_store, v_store, window, scale, out_dtype) -> out``: it writes this step's
K/V rows into the storage in place (rows by :func:`~offgraph_export.specs.manifest.storage_row`)
and attends over the valid rows; ``window`` None is a flat layer.

Implementations are imported when asked for, so choosing ``portable`` never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offgraph_export.errors import ExportError

__all__ = ["STEP_IMPLS", "StepImpl", "resolve_step_impl", "step_impl_name", "default_step_impl"]

StepImpl = Callable[..., torch.Tensor]

STEP_IMPLS = ("portable", "triton")


def default_step_impl(device: str) -> str:
    """``triton`` on cuda (reads only the valid rows), ``portable`` elsewhere."""
    return "triton" if device.startswith("cuda") else "portable"


def resolve_step_impl(impl: str | StepImpl) -> StepImpl:
    """The implementation called ``impl``; a callable is returned as is (a custom step)."""
    if callable(impl):
        return impl
    if impl == "portable":
        from offgraph_export.lowering.portable import portable_update_and_attend

        return portable_update_and_attend
    if impl == "triton":
        from offgraph_export.lowering.triton_attend import triton_update_and_attend

        return triton_update_and_attend
    raise ExportError(f"unknown step implementation {impl!r}; expected one of {STEP_IMPLS}")


def step_impl_name(impl: str | StepImpl) -> str:
    """The name recorded in the artifact's specs (a custom step's ``__name__``)."""
    return impl if isinstance(impl, str) else getattr(impl, "__name__", "custom")
