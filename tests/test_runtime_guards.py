"""The runtime refuses what would corrupt a cache without a word (issue 25's runtime class): one
session (or runner) stepped from two threads at once, a commit of a step that is not the one whose
rows storage holds, and an allocator that hands out overlapping storage. Each refusal is one line
and commits nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from offgraph_export.errors import OffgraphError, StepRefused
from offgraph_export.runtime import Session
from offgraph_export.runtime.session import Exclusive


def test_a_second_thread_is_refused_while_a_step_runs(loaded_example, example_bundle):
    """A program that blocks mid-step (the real compiled step behind a gate) lets a second thread
    try the same session: it is refused at once, and the first step commits as usual."""
    inside, release = threading.Event(), threading.Event()
    real = loaded_example.run

    class Gated:
        path, specs, single_threaded, device = loaded_example.path, loaded_example.specs, False, loaded_example.device

        def method_for(self, width):
            return loaded_example.method_for(width)

        def run(self, flat_inputs, width=None):
            inside.set()
            release.wait(30)
            return real(flat_inputs, width)

    session = Session(Gated())
    inputs = example_bundle.make_inputs(torch.tensor([[1, 2, 3]]), 0)
    worker = threading.Thread(target=session.step, args=inputs)
    worker.start()
    assert inside.wait(30)
    for call in (lambda: session.step(*inputs), lambda: session.prepare(inputs), session.reset, session.close):
        with pytest.raises(StepRefused, match="being stepped by another thread"):
            call()
    release.set()
    worker.join(30)
    assert session.committed_length == 3 and not session.closed


def test_only_the_step_that_ran_last_commits(loaded_example, example_bundle):
    """Two steps prepared at one length: after the second one ran, the first one's rows are no
    longer what storage holds, so it cannot be committed; a step that never ran cannot either."""
    session = loaded_example.new_session()
    tokens = torch.tensor([[5, 6, 7, 8]])
    first = session.prepare(example_bundle.make_inputs(tokens[:, :2], 0))
    second = session.prepare(example_bundle.make_inputs(tokens[:, 2:4], 0))
    with pytest.raises(StepRefused, match="not the step that last ran"):
        session.commit(first)  # never ran
    session.run(first)
    session.run(second)
    with pytest.raises(StepRefused, match="not the step that last ran"):
        session.commit(first)
    assert session.committed_length == 0
    session.commit(second)
    assert session.committed_length == 2


@pytest.mark.parametrize("how", ["same-buffer", "overlapping-views"])
def test_an_allocator_handing_out_overlapping_storage_is_refused(loaded_example, how):
    pool = torch.empty(1 << 20)
    handed: list[torch.Tensor] = []

    def aliasing(shape, dtype, device):
        n = int(torch.Size(shape).numel())
        start = 0 if how == "same-buffer" else len(handed) * (n // 2)
        t = pool[start : start + n].view(shape)
        handed.append(t)
        return t

    with pytest.raises(OffgraphError, match="overlapping storage: tensors 0 and 1 share memory"):
        loaded_example.new_session(allocator=aliasing)


def test_the_guard_refuses_nested_entry_and_releases():
    guard = Exclusive("runner")
    with guard:
        with pytest.raises(StepRefused, match="this runner is being stepped"):
            with guard:
                pass
    with guard:  # released
        pass
