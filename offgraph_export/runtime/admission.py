"""Admission: decide, from shapes and metadata alone, whether a step may run.

AOTInductor packages do not check their inputs (``AOTI_RUNTIME_CHECK_INPUTS`` is off by
default), so an out-of-range shape would run silently and corrupt the cache. Every check here
reads only tensor metadata (never contents, which may live on the GPU) and runs before the
compiled program is launched; a refusal leaves the session untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offgraph_export.errors import StepRefused
from offgraph_export.specs.artifact import ArtifactSpecs

__all__ = ["admit_step"]


def admit_step(specs: ArtifactSpecs, inputs: Sequence[object], committed_length: int) -> int:
    """Validate a step's model inputs; return its width (tokens written)."""
    expected = specs.inputs
    names = [s.name for s in expected]
    if len(inputs) != len(expected):
        raise StepRefused(
            f"expected {len(expected)} model inputs {names} (storage is bound by the runtime), "
            f"got {len(inputs)}"
        )
    width_spec = specs.step_width
    bindings: dict[str, tuple[int, str]] = {}
    for i, (x, spec) in enumerate(zip(inputs, expected)):
        label = f"input {i} ({spec.name})"
        if not isinstance(x, torch.Tensor):
            raise StepRefused(f"{label} must be a tensor, got {type(x).__name__}")
        if x.dtype != getattr(torch, spec.dtype):
            raise StepRefused(f"{label} must be {spec.dtype}, got {x.dtype}")
        if x.device.type != specs.device:
            raise StepRefused(f"{label} must be on {specs.device}, got {x.device}")
        if x.dim() != len(spec.shape):
            raise StepRefused(
                f"{label} must have rank {len(spec.shape)} (shape {spec.shape}), got shape "
                f"{tuple(x.shape)}"
            )
        for d, (got, want) in enumerate(zip(x.shape, spec.shape)):
            if isinstance(want, int):
                if got != want:
                    raise StepRefused(f"{label} dim {d} must be {want}, got {got} (shape {tuple(x.shape)})")
                continue
            if want in bindings and bindings[want][0] != got:
                other, where = bindings[want]
                raise StepRefused(
                    f"{label} dim {d} is {got} but {where} is {other}; both are the dynamic size {want}"
                )
            bindings.setdefault(want, (got, f"{label} dim {d}"))
            rng = specs.symbols.get(want)
            if rng is not None and (got < rng.min or (rng.max is not None and got > rng.max)):
                raise StepRefused(
                    f"{label} dim {d} is {got}, outside the compiled range [{rng.min}, {rng.max}]"
                )
    width = int(inputs[width_spec.input_index].shape[width_spec.dim])  # type: ignore[union-attr]
    manifest = specs.manifest
    if width < 1:
        raise StepRefused(f"step width is {width} (input {width_spec.input_index} dim {width_spec.dim}); a step writes at least one token")
    if width > manifest.max_write:
        raise StepRefused(f"step width {width} exceeds max_write={manifest.max_write}")
    if manifest.has_flat and committed_length + width > manifest.max_capacity:
        raise StepRefused(
            f"step of {width} tokens at length {committed_length} exceeds the max capacity of "
            f"{manifest.max_capacity} tokens; reset the session or export with a larger --max-capacity"
        )
    return width
