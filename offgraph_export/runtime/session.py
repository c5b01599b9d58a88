"""A session: one user's cache over a shared loaded program.

Each step is prepare -> run -> commit:
  1. prepare: read the width from the spec (shapes only), admit or refuse, check or make the
     positions and check table indices (``input_values``), grow storage if needed;
  2. run: the compiled program on the model inputs followed by this session's storage;
  3. commit: advance the committed length by the width, only if the run returned normally.
A failed run leaves the length where it was; rows it may have written lie beyond the committed
length, are masked by the next step's positions and overwritten by it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from offgraph_export.errors import CacheOverflowError, OffgraphError, StepFailed, StepRefused, first_line
from offgraph_export.runtime.admission import Admission, positions_suppliable
from offgraph_export.runtime.input_values import InputValues
from offgraph_export.runtime.program import LoadedProgram
from offgraph_export.runtime.storage import Allocator, SessionStorage, default_allocator
from offgraph_export.specs.artifact import DECODE_METHOD

__all__ = ["Exclusive", "PreparedStep", "Session", "SessionMetrics"]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense(x: torch.Tensor) -> torch.Tensor:
    """The compiled code indexes inputs as contiguous (AOTI does not check strides: a strided
    view such as ``ids[:, a:b]`` of a batch > 1 would be misread silently) and assumes 16-byte
    aligned data (a misaligned view makes AOTI copy it with a warning on every call). Contiguous
    means the one layout of the shape, size-1 dims included: ``is_contiguous`` ignores their
    strides, the compiled wrappers' own checks (``AOTI_RUNTIME_CHECK_INPUTS=1``) do not."""
    if x.stride() == _contiguous_strides(x.shape) and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class PreparedStep:
    """An admitted step: its width and the inputs the program runs on (dense, positions owned
    by the runtime; ``None`` in place of positions a captured CUDA graph supplies itself), and the
    session state it was admitted against (``length``, ``epoch``): it may run and commit only
    while the session is still there (no commit, reset or close since)."""

    width: int
    inputs: list[torch.Tensor]
    length: int
    epoch: tuple[int, int]
    #: which prepared step this is (a session commits only the step that ran last, successfully)
    ticket: int = 0


class SessionMetrics(BaseModel):
    committed_length: int
    capacity: int
    growth_count: int
    allocated_bytes: int
    steps: int
    failed_steps: int
    refused_steps: int
    graph_captures: int = 0
    graph_replays: int = 0
    #: committed steps the artifact's decode method ran (the rest ran the general step)
    decode_method_steps: int = 0


_SESSION_SERIALS = itertools.count()
_TICKETS = itertools.count(1)


class Exclusive:
    """One thread at a time in a session's (or a runner's) steps: a second thread is refused at
    once, not made to wait: two threads stepping one cache is a caller's bug that would interleave
    their rows."""

    def __init__(self, what: str = "session") -> None:
        self._lock = threading.Lock()
        self._what = what

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise StepRefused(f"this {self._what} is being stepped by another thread; it serves one caller at a time")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class Session:
    def __init__(
        self,
        artifact: LoadedProgram,
        allocator: Allocator = default_allocator,
        poison: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        self.artifact = artifact
        self.specs = artifact.specs
        self.storage = SessionStorage(self.specs.manifest, artifact.device, allocator, poison)
        self._admit = Admission(self.specs, artifact.device)
        self._values = InputValues(self.specs, artifact.device)
        self.committed_length = 0
        self.closed = False
        self._steps = self._failed = self._refused = self._decode_steps = 0
        #: advanced by every commit, reset and close: a PreparedStep runs only in the epoch it was
        #: admitted in, of the session it was admitted by (serial numbers are never reused)
        self._epoch = 0
        self._serial = next(_SESSION_SERIALS)
        self._graphs = None
        self._graph_counts = (0, 0)
        #: a bare graph replay (replay_graph) wrote rows the history may need: steps wait for reset()
        self._spent = False
        self._supply_positions = positions_suppliable(self.specs)
        self._exclusive = Exclusive()
        #: the ticket of the step that last ran to completion in this epoch (0: none)
        self._ran = 0
        if cuda_graphs:
            from offgraph_export.runtime.cuda_graph import DecodeGraphs

            self._graphs = DecodeGraphs(
                artifact, self.storage, self.specs.positions_input, self._values.positions_shape
            )

    # -- the step -------------------------------------------------------------------------------
    def prepare(self, inputs: Sequence[torch.Tensor | None]) -> PreparedStep:
        """Admit the step and grow storage for it. Changes nothing on refusal. The positions input
        may be ``None`` (the session supplies them) where ``admission.positions_suppliable``."""
        with self._exclusive:
            return self._prepare(inputs)

    def _prepare(self, inputs: Sequence[torch.Tensor | None]) -> PreparedStep:
        if self.closed:
            self._refused += 1
            raise StepRefused("this session is closed; open a new one with artifact.new_session()")
        if self._spent:
            self._refused += 1
            raise StepRefused("this session replayed its graph bare (replay_graph) and its cache no longer holds its history; reset() it")
        try:
            width = self._admit(inputs, self.committed_length)
            graphed = self._graphs is not None and self._graphs.accepts(width)
            owned = self._values.apply(inputs, width, self.committed_length, materialize=not graphed)
        except StepRefused:
            self._refused += 1
            raise
        try:
            self.storage.ensure(self.committed_length + width, self.committed_length)
        except Exception as exc:  # the allocator may raise anything (OOM, ...): storage unchanged
            self._refused += 1
            raise StepRefused(
                f"could not grow storage to {self.committed_length + width} tokens (cache unchanged): {exc}"
            ) from exc
        return PreparedStep(
            width, [x if x is None else _dense(x) for x in owned], self.committed_length, self._epoch_key(),
            next(_TICKETS),
        )

    def _epoch_key(self) -> tuple[int, int]:
        return (self._serial, self._epoch)

    def _check_current(self, step: PreparedStep, action: str) -> None:
        """Refuse to run or commit a step admitted against another state of this session (or
        another session): its positions and storage rows would no longer be the session's."""
        if self.closed:
            self._refused += 1
            raise StepRefused("this session is closed; open a new one with artifact.new_session()")
        if step.epoch != self._epoch_key():
            self._refused += 1
            raise StepRefused(
                f"cannot {action} a step prepared at length {step.length}: the session has moved on "
                f"(a commit, reset or another session since; its length is {self.committed_length}); "
                "prepare the step again"
            )

    def run(self, step: PreparedStep) -> list[torch.Tensor]:
        """Launch the compiled program on prepared storage (no commit). Refused (StepRefused) for a
        step prepared before the session's last commit, reset or close."""
        with self._exclusive:
            self._check_current(step, "run")
            self._ran = 0  # until it returns: a step that raised is not committable
            outputs = self._launch(step)
            self._ran = step.ticket
            return outputs

    def _launch(self, step: PreparedStep) -> list[torch.Tensor]:
        if self._graphs is not None and self._graphs.accepts(step.width):
            return self._graphs.run(step.inputs, self.committed_length)
        return self.artifact.run([*step.inputs, *self.storage.bound()], width=step.width)

    def commit(self, step: PreparedStep) -> None:
        """Advance the session by the step's width: only the step whose run returned last (a
        step that never ran, raised, or was overwritten by another step's run since is refused:
        its rows are not the ones storage holds)."""
        with self._exclusive:
            self._check_current(step, "commit")
            if self._ran != step.ticket:
                self._refused += 1
                raise StepRefused(
                    f"cannot commit the step prepared at length {step.length}: it is not the step that last ran "
                    "to completion (it never ran, it raised, or another step ran since); run it again first"
                )
            self._advance(step)

    def _advance(self, step: PreparedStep) -> None:
        self._ran = 0
        self._epoch += 1
        self.committed_length += step.width
        self._steps += 1
        if self.artifact.method_for(step.width) == DECODE_METHOD:
            self._decode_steps += 1

    def step(self, *inputs: torch.Tensor | None) -> list[torch.Tensor]:
        """prepare -> run -> commit. Returns the program's outputs."""
        with self._exclusive:
            return self._step(inputs)

    def _step(self, inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        prepared = self._prepare(inputs)  # current by construction: run and commit need no check
        try:
            outputs = self._launch(prepared)
        except Exception as exc:  # the compiled program's C++ errors surface as RuntimeError
            self._failed += 1
            raise StepFailed(
                f"compiled step of {prepared.width} tokens at length {self.committed_length} failed; "
                f"the cache was not advanced: {first_line(exc)}"
            ) from exc
        self._advance(prepared)
        return outputs

    def feed(
        self, make_inputs: Callable[[torch.Tensor, int], Sequence[torch.Tensor]], tokens: torch.Tensor
    ) -> list[torch.Tensor]:
        """Step ``tokens`` (ids ``[batch, T]``) at the committed length, the runtime supplying the
        positions: the model inputs are ``make_inputs(tokens, committed_length)`` (a bundle's
        input builder) with the positions input left to the session wherever it can supply it
        (``admission.positions_suppliable``; elsewhere the built positions are checked as any
        step's). The one way to feed tokens: no caller computes or passes positions."""
        inputs = list(make_inputs(tokens, self.committed_length))
        if self._supply_positions:
            inputs[self.specs.positions_input] = None  # type: ignore[index]
        return self.step(*inputs)

    def replay_graph(self) -> None:
        """Replay the captured decode step as it stands, with no input copies and no runtime
        work before it: what a benchmark times to see the runtime's host work per step (a full
        step minus this). It writes rows past the committed length, ring rows the history still
        needs among them, so afterwards the session refuses steps until :meth:`reset`."""
        graphs = self._graphs
        if self.closed or graphs is None or graphs.graph is None:
            raise StepRefused("no captured decode graph: open the session with cuda_graphs=True and run a one-token step first")
        self._spent = True
        graphs.replay_bare()

    # -- lifecycle ------------------------------------------------------------------------------
    def reserve(self, tokens: int) -> bool:
        """Grow flat storage now to hold ``tokens`` tokens in all (history included), exactly that
        many rows, instead of doubling as steps need more: a caller that knows the session's length
        (a prompt and how many tokens to generate) allocates what it needs and never moves storage
        mid-generation. Returns whether storage moved. Raises :class:`CacheOverflowError` past the
        max capacity and :class:`StepRefused` (storage unchanged) when the allocation fails."""
        if self.closed:
            raise StepRefused("this session is closed; open a new one with artifact.new_session()")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise OffgraphError(f"reserve takes a token count >= 0, got {tokens!r}")
        try:
            return self.storage.reserve(tokens, self.committed_length)
        except CacheOverflowError:
            raise
        except Exception as exc:  # the allocator may raise anything (OOM, ...): storage unchanged
            raise StepRefused(f"could not reserve storage for {tokens} tokens (cache unchanged): {exc}") from exc

    def reset(self) -> None:
        """Forget the history; storage (and its capacity) is kept for reuse."""
        with self._exclusive:
            self._reset()

    def _reset(self) -> None:
        if self.closed:
            raise StepRefused("this session is closed; open a new one with artifact.new_session()")
        self._epoch += 1
        self.committed_length = 0
        self._spent = False
        if self.storage.poison:
            self.storage.poison_from(0)

    def close(self) -> None:
        with self._exclusive:
            self._close()

    def _close(self) -> None:
        self._epoch += 1
        self.closed = True
        self.storage.release()
        if self._graphs is not None:  # the graph goes; its counts stay for metrics()
            self._graph_counts = (self._graphs.captures, self._graphs.replays)
        self._graphs = None

    def metrics(self) -> SessionMetrics:
        return SessionMetrics(
            committed_length=self.committed_length,
            capacity=self.storage.capacity,
            growth_count=self.storage.growth_count,
            allocated_bytes=self.storage.allocated_bytes(),
            steps=self._steps,
            failed_steps=self._failed,
            refused_steps=self._refused,
            graph_captures=self._graphs.captures if self._graphs else self._graph_counts[0],
            graph_replays=self._graphs.replays if self._graphs else self._graph_counts[1],
            decode_method_steps=self._decode_steps,
        )
