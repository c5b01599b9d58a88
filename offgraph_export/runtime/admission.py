"""Admission: decide, from shapes and metadata alone, whether a step may run.

AOTInductor packages do not check their inputs (``AOTI_RUNTIME_CHECK_INPUTS`` is off by
default), so an out-of-range shape would run silently and corrupt the cache. Every check here
reads only tensor metadata (never contents, which may live on the GPU) and runs before the
compiled program is launched; a refusal leaves the session untouched.

The positions input may be ``None`` (the runtime supplies the positions, ``runtime/input_values.py``)
where its shape is known from the width alone: every other dim static, and it is not the input the
width is read from. A session admits through :class:`Admission`, which runs the per-input checks once
per distinct input signature (a decode loop hands the same dtypes, devices and shapes every step) and
the length check every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offgraph_export.errors import StepRefused
from offgraph_export.specs.artifact import ArtifactSpecs

__all__ = ["Admission", "admit_step", "positions_suppliable"]


def positions_suppliable(specs: ArtifactSpecs) -> bool:
    """Whether a step may pass ``None`` for the positions input: the program takes positions, its
    dims other than the token width are static, and the width is read from another input."""
    index = specs.positions_input
    if index is None or index == specs.step_width.input_index:
        return False
    return all(isinstance(d, int) or d == specs.width_symbol for d in specs.inputs[index].shape)


def admit_step(
    specs: ArtifactSpecs, inputs: Sequence[object], committed_length: int, device: torch.device | None = None
) -> int:
    """Validate a step's model inputs; return its width (tokens written). ``device``: the
    artifact's device with its index (``cuda:0``); without it only the device type is checked."""
    return admit_length(specs, admit_shapes(specs, inputs, device), committed_length)


def admit_shapes(specs: ArtifactSpecs, inputs: Sequence[object], device: torch.device | None = None) -> int:
    """The checks that depend on the inputs' types, layouts, dtypes, devices and shapes alone;
    returns the width (tokens written), checked against ``max_write``."""
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
        if x is None and i == specs.positions_input and positions_suppliable(specs):
            continue  # the runtime supplies them, shaped from the width
        if not isinstance(x, torch.Tensor):
            raise StepRefused(f"{label} must be a tensor, got {type(x).__name__}")
        if x.dtype != getattr(torch, spec.dtype):
            raise StepRefused(f"{label} must be {spec.dtype}, got {x.dtype}")
        if x.layout != torch.strided:
            raise StepRefused(f"{label} must be a dense (strided) tensor, got layout {x.layout}")
        if x.device.type != specs.device or (device is not None and x.device != device):
            raise StepRefused(f"{label} must be on {device or specs.device}, got {x.device}")
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
            if rng is not None and not rng.min <= got <= rng.max:  # specs hold bounded ranges only
                raise StepRefused(
                    f"{label} dim {d} is {got}, outside the compiled range [{rng.min}, {rng.max}]"
                )
    width = int(inputs[width_spec.input_index].shape[width_spec.dim])  # type: ignore[union-attr]
    manifest = specs.manifest
    if width < 1:
        raise StepRefused(f"step width is {width} (input {width_spec.input_index} dim {width_spec.dim}); a step writes at least one token")
    if width > manifest.max_write:
        raise StepRefused(f"step width {width} exceeds max_write={manifest.max_write}")
    return width


def admit_length(specs: ArtifactSpecs, width: int, committed_length: int) -> int:
    """The check that depends on the session's length: a flat layer's max capacity."""
    manifest = specs.manifest
    if manifest.has_flat and committed_length + width > manifest.max_capacity:
        raise StepRefused(
            f"step of {width} tokens at length {committed_length} exceeds the max capacity of "
            f"{manifest.max_capacity} tokens; reset the session or export with a larger --max-capacity"
        )
    return width


def _signature(inputs: Sequence[object]) -> tuple | None:
    """What :func:`admit_shapes` depends on, or None where an input is neither a tensor nor None
    (such a step is checked, and refused, every time)."""
    sig = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            sig.append((x.layout, x.dtype, x.device, x.shape))
        elif x is None:
            sig.append(None)
        else:
            return None
    return tuple(sig)


class Admission:
    """:func:`admit_step` for one session, remembering the last admitted input signature
    (layouts, dtypes, devices, shapes): the per-input checks run once per signature, the length
    check every step."""

    def __init__(self, specs: ArtifactSpecs, device: torch.device | None = None) -> None:
        self.specs = specs
        self.device = device
        self._signature: tuple | None = None
        self._width = 0

    def __call__(self, inputs: Sequence[object], committed_length: int) -> int:
        signature = _signature(inputs)
        if signature is None or signature != self._signature:
            width = admit_shapes(self.specs, inputs, self.device)
            self._signature, self._width = signature, width
        return admit_length(self.specs, self._width, committed_length)
