"""The shape every pass shares: it takes a program and returns a :class:`PassResult` saying which
program comes out, whether the pass changed the graph, and what else it produced (the sites it
validated, the step-width spec, the manifest, the layers it stripped). ``run_passes`` is then a
list of steps, and a test can assert that a pass fired or left a graph alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from torch.export import ExportedProgram

__all__ = ["PassResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class PassResult(Generic[T]):
    """``program``: the program after the pass (the input itself when ``modified`` is False);
    ``produced``: the pass's own product."""

    program: ExportedProgram
    modified: bool
    produced: T
