"""CUDA graphs for decode steps (opt-in per session).

A decode step (one token) launches the same kernels every time; only the token, its position and
the storage's contents change, and the compiled code reads all three from device memory. So a
step can be captured once per storage binding and replayed: the step's inputs are copied into
static buffers, the graph replays, the outputs are copied out of its static buffers. The graph
bakes in the storage addresses and row count, so it is re-captured only when storage moves
(growth, seen as a new ``SessionStorage.generation``): at most
``ceil(log2(max_capacity / initial_capacity))`` times after the first capture. Prefill steps (more
than one token) run with ordinary launches.

The runtime owns the position (``runtime/input_values.py``), so the graph keeps it itself: the
captured step ends by advancing its static position by one, and before a replay the host writes
the position only when the session's length is not the one the last replay left there (the first
step after a capture, a prefill, a reset or a failed step). A decode loop thus costs, before the
replay, one copy (the token) and no work for the position.

The artifact must be loaded with ``single_threaded=True`` (AOTInductor's capturable runner).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from offgraph_export.errors import StepRefused
from offgraph_export.runtime.program import LoadedProgram
from offgraph_export.runtime.storage import SessionStorage

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """The captured decode step of one session. ``positions_index``: which input carries the
    positions (None: none does); ``positions_shape``: the shape of runtime-supplied positions of a
    given width (``InputValues.positions_shape``), asked for where a step's positions are None."""

    def __init__(
        self,
        artifact: LoadedProgram,
        storage: SessionStorage,
        positions_index: int | None,
        positions_shape: Callable[[int], list[int]],
    ) -> None:
        if artifact.device.type != "cuda":
            raise StepRefused("CUDA graphs need a cuda artifact")
        if not artifact.single_threaded:
            raise StepRefused(
                "CUDA graphs need the artifact loaded for capture: load_artifact(path, single_threaded=True)"
            )
        self.artifact = artifact
        self.storage = storage
        self.graph: torch.cuda.CUDAGraph | None = None
        self.generation = -1
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.captures = 0
        self.replays = 0
        self._positions_index = positions_index
        self._positions_shape = positions_shape
        #: the position the static positions buffer holds after the last replay (None: unknown)
        self._next_position: int | None = None

    def accepts(self, width: int) -> bool:
        return width == 1

    def _static_input(self, x: torch.Tensor | None, position: int) -> torch.Tensor:
        if x is None:  # the runtime's position, which the graph keeps and advances itself
            return torch.full(self._positions_shape(1), position, dtype=torch.int64, device=self.artifact.device)
        return x.clone()

    def _capture(self, inputs: Sequence[torch.Tensor | None], position: int) -> None:
        artifact = self.artifact
        storage = list(self.storage.bound())
        self.static_inputs = [self._static_input(x, position) for x in inputs]
        index = self._positions_index
        positions = self.static_inputs[index] if index is not None and inputs[index] is None else None
        # Warm up on a side stream (first launches may allocate or initialize), then capture. The
        # warm-up performs this step's writes; the replay below writes the same rows again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            artifact.run([*self.static_inputs, *storage], width=1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_outputs = artifact.run([*self.static_inputs, *storage], width=1)
            if positions is not None:
                positions.add_(1)  # the next step's position, for the next replay
        self.graph = graph
        self.generation = self.storage.generation
        self.captures += 1

    def replay_bare(self) -> None:
        """Replay the captured step as it stands (its static inputs as the last step left them);
        the position it holds afterwards is not the session's, so the next step writes it."""
        assert self.graph is not None
        self._next_position = None
        self.graph.replay()
        self.replays += 1

    def run(self, inputs: Sequence[torch.Tensor | None], position: int) -> list[torch.Tensor]:
        """Replay the step at ``position`` (the session's length) on ``inputs``; ``None`` in place of
        positions the graph supplies."""
        known = self._next_position
        self._next_position = None  # unknown until the replay is launched (a copy may raise)
        if self.graph is None or self.storage.generation != self.generation:
            self._capture(inputs, position)
        else:
            for static, x in zip(self.static_inputs, inputs):
                if x is not None:
                    static.copy_(x)
                elif position != known:
                    static.fill_(position)
        assert self.graph is not None
        self.graph.replay()
        self.replays += 1
        if self._positions_index is not None:
            self._next_position = position + 1
        return [out.clone() for out in self.static_outputs]
