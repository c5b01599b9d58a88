"""CUDA graphs for decode steps (opt-in per session).

A decode step (one token) launches the same kernels every time; only the token, its position and
the storage's contents change, and the compiled code reads all three from device memory. So a
step can be captured once per storage binding and replayed: the step's inputs are copied into
static buffers, the graph replays, the outputs are copied out of its static buffers. The graph
bakes in the storage addresses and row count, so it is re-captured only when storage moves
(growth): at most ``ceil(log2(max_capacity / initial_capacity))`` times after the first capture.
Prefill steps (more than one token) run with ordinary launches.

The artifact must be loaded with ``single_threaded=True`` (AOTInductor's capturable runner).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offgraph_export.errors import StepRefused

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    def __init__(self, session) -> None:
        if session.artifact.device.type != "cuda":
            raise StepRefused("CUDA graphs need a cuda artifact")
        self.session = session
        self.graph: torch.cuda.CUDAGraph | None = None
        self.binding: tuple[int, ...] = ()
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.captures = 0
        self.replays = 0

    def accepts(self, width: int) -> bool:
        return width == 1

    def _binding_key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.session.storage.bound())

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        artifact = self.session.artifact
        storage = list(self.session.storage.bound())
        self.static_inputs = [x.clone() for x in inputs]
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
        self.graph = graph
        self.binding = self._binding_key()
        self.captures += 1

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.graph is None or self._binding_key() != self.binding:
            self._capture(inputs)
        else:
            for static, x in zip(self.static_inputs, inputs):
                static.copy_(x)
        assert self.graph is not None
        self.graph.replay()
        self.replays += 1
        return [out.clone() for out in self.static_outputs]
