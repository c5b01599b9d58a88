"""The registry of lowered step implementations: the code the strip pass puts where the neutral op
was. Each has the signature of :func:`~offgraph_export.kernels.portable.portable_update_and_attend`
``(q, k, v, position, k_store, v_store, window, scale, out_dtype) -> out``: it writes this step's
K/V rows into the storage in place (rows by :func:`~offgraph_export.specs.manifest.storage_row`)
and attends over the valid rows; ``window`` None is a flat layer. A layer with soft-capping or
sinks also gets keywords ``softcap`` (a float) and ``sinks`` (``[Hq]``), and only then, so a custom
step without them still serves every other model; the batched (paged) steps take neither, and the
strip pass refuses such a layer for them.

Implementations are imported when asked for, so choosing ``portable`` never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offgraph_export.errors import ExportError
from offgraph_export.options import STEP_IMPLS  # the names; which is a device's default: options.py

__all__ = ["STEP_IMPLS", "StepImpl", "resolve_step_impl", "step_impl_name"]

StepImpl = Callable[..., torch.Tensor]


def resolve_step_impl(impl: str | StepImpl, paged: bool = False) -> StepImpl:
    """The implementation called ``impl``; a callable is returned as is (a custom step).
    ``paged``: the batched step over paged storage (design section 10), whose signature adds the
    four batch inputs after the storage: ``(q, k, v, position, k_store, v_store, token_slots,
    token_rows, page_table, session_lengths, window, scale, out_dtype)``."""
    if callable(impl):
        return impl
    if paged and impl == "portable":
        from offgraph_export.kernels.portable_paged import portable_paged_update_and_attend

        return portable_paged_update_and_attend
    if paged and impl == "triton":
        from offgraph_export.kernels.paged_attend import triton_paged_update_and_attend

        return triton_paged_update_and_attend
    if impl == "portable":
        from offgraph_export.kernels.portable import portable_update_and_attend

        return portable_update_and_attend
    if impl == "triton":
        from offgraph_export.kernels.triton_attend import triton_update_and_attend

        return triton_update_and_attend
    raise ExportError(f"unknown step implementation {impl!r}; expected one of {STEP_IMPLS}")


def step_impl_name(impl: str | StepImpl) -> str:
    """The name recorded in the artifact's specs (a custom step's ``__name__``)."""
    return impl if isinstance(impl, str) else getattr(impl, "__name__", "custom")
