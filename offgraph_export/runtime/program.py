"""What the runtime needs of a loaded program, named once.

:class:`~offgraph_export.runtime.session.Session`, :class:`~offgraph_export.runtime.cuda_graph.DecodeGraphs`,
``check`` and ``generate`` drive a program through this protocol only, so they work the same over
an AOTInductor package (:class:`~offgraph_export.runtime.artifact.Artifact`) and an ExecuTorch
program (:class:`~offgraph_export.runtime.pte_artifact.PteArtifact`), and import neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from offgraph_export.specs.artifact import ArtifactSpecs

__all__ = ["LoadedProgram"]


@runtime_checkable
class LoadedProgram(Protocol):
    """A loaded, checked program and its specs; one serves many sessions (weights loaded once)."""

    #: where it was loaded from
    path: Path
    #: its specs, checked against the compiled code at load
    specs: ArtifactSpecs
    #: loaded with a capturable (single-threaded) runner: CUDA graphs may capture its steps
    single_threaded: bool

    @property
    def device(self) -> torch.device:
        """The device it runs on, with its index (``cuda:0``)."""
        ...

    def method_for(self, width: int | None, one_row_per_session: bool = False) -> str:
        """The name of the method that runs a step of ``width`` tokens (None: the general step);
        ``one_row_per_session``: a batched decode step, every token its session's only new row."""
        ...

    @property
    def general_min_width(self) -> int:
        """The fewest tokens the general method was compiled for (a batched runner pads a
        narrower step up to it with scratch tokens)."""
        ...

    def run(
        self, flat_inputs: Sequence[torch.Tensor], width: int | None = None, one_row_per_session: bool = False,
    ) -> list[torch.Tensor]:
        """Run the step of ``width`` tokens on model inputs followed by storage (a flat list),
        writing the storage in place; returns the model's outputs. ``one_row_per_session``: as
        for :meth:`method_for` (the caller's promise; the method it picks relies on it)."""
        ...
