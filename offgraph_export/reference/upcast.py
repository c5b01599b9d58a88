"""A float32 reference for checking half-precision artifacts (design section 6).

Why: ``check`` compares a bf16/fp16 artifact with the eager model in the same dtype under a fixed
tolerance. That holds for shallow models, but two bf16 computations of a deep model drift apart
layer after layer whatever their order of operations (eager bf16 against fp32 on a random Llama of
hidden 2048: 2.1% of the largest logit at 16 layers, 4.2% at 32; a random 32-layer Llama-3.1-8B
shape on cuda: K/V of layers 0-12 within the bf16 tolerance, the deepest up to 1.5x over it), so
the fixed rule cannot tell drift from a bug there. The accepted answer (as
in PyTorch's own accuracy checks, ``torch._dynamo.utils.same`` with an fp64 reference) is to
measure both against a higher-precision run of the same weights: the artifact passes when its
error against that reference is no more than :data:`REFERENCE_MULTIPLIER` times the eager
model's own error against it, plus a small floor.

:class:`Float32Twin` runs the same module objects with float32 copies of their half-precision
parameters and buffers (the values the model holds, upcast exactly), swapped in for one block and
restored bit for bit after; :func:`reference_errors` applies the rule. No transformers, no
runtime: the oracle is whatever the caller steps inside :meth:`Float32Twin.active`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["REFERENCE_MULTIPLIER", "HALF_DTYPES", "Float32Twin", "ReferenceErrors", "reference_errors"]

#: the artifact may be this many times further (RMS) from the float32 reference than the eager
#: model in the artifact's dtype is (``torch._dynamo.utils.same`` uses 2-3)
REFERENCE_MULTIPLIER = 2.0
#: dtypes whose models get a float32 reference
HALF_DTYPES = (torch.bfloat16, torch.float16)


class Float32Twin:
    """The model's half-precision tensors as float32 copies, swapped in by :meth:`active`.

    Made once (the copies cost twice the half-precision bytes); each :meth:`active` block points
    every half-precision parameter and buffer at its float32 copy and points it back after, so
    the model's own tensors are never written."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._swaps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) in seen or tensor.dtype not in HALF_DTYPES:
                continue
            seen.add(id(tensor))
            self._swaps.append((tensor, tensor.data, tensor.detach().float()))

    @property
    def tensors(self) -> int:
        """How many tensors the twin upcasts."""
        return len(self._swaps)

    @contextmanager
    def active(self) -> Iterator[None]:
        for tensor, _, wide in self._swaps:
            tensor.data = wide
        try:
            yield
        finally:
            for tensor, original, _ in self._swaps:
                tensor.data = original


@dataclass(frozen=True)
class ReferenceErrors:
    """RMS differences from the float32 reference: the artifact's and the eager model's."""

    artifact: float
    eager: float
    allowed: float

    @property
    def ok(self) -> bool:
        return self.artifact <= self.allowed  # NaN fails


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    d = a.double() - b.double()
    return float(d.square().mean().sqrt()) if d.numel() else 0.0


def reference_errors(got: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, floor: float) -> ReferenceErrors:
    """The rule: RMS(got - reference) <= REFERENCE_MULTIPLIER * RMS(eager - reference) + floor,
    over the elements where ``reference`` is finite (elsewhere the caller's own rule holds)."""
    finite = torch.isfinite(reference)
    got, eager, reference = got[finite], eager[finite], reference[finite]
    e_eager = _rms(eager, reference)
    return ReferenceErrors(_rms(got, reference), e_eager, REFERENCE_MULTIPLIER * e_eager + floor)
