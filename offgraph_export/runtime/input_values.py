"""The values of a step's inputs that the runtime owns or bounds, checked without a device sync.

* Positions: the step's tokens sit at positions ``committed_length .. committed_length + width - 1``
  and nowhere else. A host (CPU) positions tensor is compared with that and the step is refused if
  it differs (skipped, rewound or negative positions never reach the program). A device tensor is
  not read (that would cost a device-to-host sync per step): the runtime puts its own positions in
  its place, a view of a per-session table on the device (no kernel launch). ``None`` (where
  ``admission.positions_suppliable``) is replaced the same way, on any device. A caller that
  runs the step as a captured CUDA graph asks for no tensor at all (``materialize=False``): the
  graph keeps its own copy of the position (``runtime/cuda_graph.py``).
* Table indices (token ids into the embedding): a host tensor outside ``[0, index_bound)`` is
  refused before launch; a device tensor is not read, and the program clamps indices into the
  table itself (``passes/bound_table_indices.py``), so a bad id cannot read out of bounds or trip a
  device-side assert that would take down every session of the process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offgraph_export.errors import StepRefused
from offgraph_export.specs.artifact import ArtifactSpecs

__all__ = ["InputValues"]


def _on_host(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


#: Positions the per-session table holds at most (16 MB of int64 slots): it is sized by the
#: archive's ``max_capacity + max_write``, which an archive may put at 2**31 (a 32 GiB table on
#: the first step); positions past it are made per step like a ring-only model's.
TABLE_POSITIONS = 1 << 20


class InputValues:
    """One session's owner of positions and guard of table indices."""

    def __init__(self, specs: ArtifactSpecs, device: torch.device) -> None:
        self.specs = specs
        self.device = device
        self._table: torch.Tensor | None = None
        manifest = specs.manifest
        self._table_size = min(manifest.max_capacity + manifest.max_write, TABLE_POSITIONS)
        self._bounded = [(i, s.index_bound) for i, s in enumerate(specs.inputs) if s.index_bound]
        self._token_dim = None
        if specs.positions_input is not None:
            shape = specs.inputs[specs.positions_input].shape
            self._token_dim = shape.index(specs.width_symbol)

    def _positions(self, start: int, width: int) -> torch.Tensor:
        """``arange(start, start + width)`` on the device, from a table made once per session.
        Each entry has a 16-byte slot of its own (the value, then a copy), so a one-token step
        gets a one-element view aligned as the compiled code requires, read in place; a view of
        a plain table would sit at an odd 8-byte offset every other step and be copied. A wider
        step gets a strided view, which the session makes dense."""
        size = self._table_size
        if start + width > size:  # past the table (ring-only models have no capacity bound): make them
            return torch.arange(start, start + width, dtype=torch.int64, device=self.device)
        if self._table is None:
            self._table = torch.arange(size, dtype=torch.int64, device=self.device).repeat_interleave(2)
        return self._table[2 * start : 2 * (start + width) : 2]

    def positions_shape(self, width: int) -> list[int]:
        """The shape of supplied positions (a ``None`` positions input): the width along the token
        dim, the recorded static size elsewhere."""
        assert self.specs.positions_input is not None
        spec = self.specs.inputs[self.specs.positions_input]
        return [width if d == self._token_dim else int(n) for d, n in enumerate(spec.shape)]

    def apply(
        self,
        inputs: Sequence[torch.Tensor | None],
        width: int,
        committed_length: int,
        materialize: bool = True,
    ) -> list[torch.Tensor | None]:
        """The inputs to run: positions checked or replaced, indices checked. Raises
        :class:`StepRefused` naming the input; changes nothing. ``materialize=False``: positions
        the runtime would supply are left as ``None`` (a captured graph holds its own)."""
        out = list(inputs)
        for i, bound in self._bounded:
            x = out[i]
            if _on_host(x) and x.numel():
                lo, hi = int(x.min()), int(x.max())
                if lo < 0 or hi >= bound:
                    bad = lo if lo < 0 else hi
                    raise StepRefused(
                        f"input {i} ({self.specs.inputs[i].name}) holds {bad}, outside [0, {bound}): "
                        "it indexes a table of that many rows"
                    )
        index = self.specs.positions_input
        if index is None:
            return out
        x = out[index]
        if x is not None and _on_host(x):
            shape = [1] * x.dim()
            shape[self._token_dim] = width  # type: ignore[index]
            expected = torch.arange(committed_length, committed_length + width, dtype=torch.int64)
            if not torch.equal(x, expected.view(shape).expand(x.shape)):
                got = x.reshape(-1)[: min(4, x.numel())].tolist()
                raise StepRefused(
                    f"input {index} ({self.specs.inputs[index].name}) starts {got}; this session's "
                    f"step must carry positions {committed_length}..{committed_length + width - 1} "
                    f"(its committed length is {committed_length}); reset the session to start over"
                )
            return out
        if not materialize:
            out[index] = None
            return out
        full = self.positions_shape(width) if x is None else list(x.shape)
        shape = [1] * len(full)
        shape[self._token_dim] = width  # type: ignore[index]
        out[index] = self._positions(committed_length, width).view(shape).expand(full)
        return out
