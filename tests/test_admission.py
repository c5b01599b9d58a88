"""Admission: malformed steps are refused with :class:`StepRefused` before the compiled program
runs, and leave the session exactly as it was.

The compiled example takes ``tokens [1, T]`` int64 and ``position [T]`` int64 with T in [1, 32]
(max_write), then four storage tensors the runtime binds itself; capacity 16 -> 256 tokens.
That the program did not run is proven three ways: a spy around the artifact's ``run`` is not
called, the storage tensors are bit-identical, and the session counts no failed step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offgraph_export.errors import StepRefused
from offgraph_export.reference import ReferenceCaches
from offgraph_export.runtime import Artifact, admit_step

MAX_WRITE = 32
MAX_CAPACITY = 256
START = 5  # tokens committed before the malformed step (unless a case says otherwise)


def tok(n: int, seed: int = 0, dtype=torch.int64, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed)).to(dtype)


def pos(start: int, n: int, dtype=torch.int64) -> torch.Tensor:
    return torch.arange(start, start + n).to(dtype)


class Case:
    def __init__(self, id, make, match, setup=START, close=False):
        self.id, self.make, self.match, self.setup, self.close = id, make, match, setup, close


# make(session, start) -> the inputs handed to session.step(*inputs)
CASES = [
    # the width input (tokens): rank, dtype, device
    Case("tokens-rank-1", lambda s, t: (tok(3)[0], pos(t, 3)), "rank 2"),
    Case("tokens-rank-3", lambda s, t: (tok(3)[None], pos(t, 3)), "rank 2"),
    Case("tokens-rank-0", lambda s, t: (torch.tensor(7), pos(t, 1)), "rank 2"),
    Case("tokens-int32", lambda s, t: (tok(3, dtype=torch.int32), pos(t, 3)), "tokens.*must be int64"),
    Case("tokens-float32", lambda s, t: (tok(3, dtype=torch.float32), pos(t, 3)), "tokens.*must be int64"),
    Case("tokens-bool", lambda s, t: (tok(3) > 100, pos(t, 3)), "must be int64, got torch.bool"),
    Case("tokens-wrong-device", lambda s, t: (torch.zeros(1, 3, dtype=torch.int64, device="meta"), pos(t, 3)), "must be on cpu, got meta"),
    # the width itself
    Case("width-0", lambda s, t: (tok(0), pos(t, 0)), "dim 1 is 0, outside the compiled range"),
    Case("width-over-max-write", lambda s, t: (tok(33), pos(t, 33)), r"33, outside the compiled range \[1, 32\]"),
    Case("width-far-over-max-write", lambda s, t: (tok(200), pos(t, 200)), "outside the compiled range"),
    Case("over-capacity", lambda s, t: (tok(3), pos(t, 3)), "3 tokens at length 254 exceeds the max capacity of 256", setup=254),
    Case("over-capacity-when-full", lambda s, t: (tok(1), pos(t, 1)), "at length 256 exceeds the max capacity", setup=256),
    Case("over-capacity-by-max-write", lambda s, t: (tok(32), pos(t, 32)), "32 tokens at length 225 exceeds", setup=225),
    # input count: missing, extra, storage handed in by the caller
    Case("positions-missing", lambda s, t: (tok(3),), r"expected 2 model inputs \['tokens', 'position'\].*got 1"),
    Case("no-inputs", lambda s, t: (), "expected 2 model inputs.*got 0"),
    Case("extra-storage-wrong-dtype", lambda s, t: (tok(3), pos(t, 3), torch.zeros(1, 2, 16, 16, dtype=torch.float16)), "storage is bound by the runtime.*got 3"),
    Case("extra-storage-wrong-shape", lambda s, t: (tok(3), pos(t, 3), torch.zeros(1, 2, 7, 16)), "storage is bound by the runtime.*got 3"),
    Case("all-storage-handed-in", lambda s, t: (tok(3), pos(t, 3), *s.storage.bound()), "storage is bound by the runtime.*got 6"),
    Case("storage-instead-of-position", lambda s, t: (tok(3), s.storage.bound()[0]), "position.*must be int64, got torch.float32"),
    # shapes that disagree with each other or with the static dims
    Case("tokens-positions-disagree", lambda s, t: (tok(3), pos(t, 4)), "dim 0 is 4 but input 0 \\(tokens\\) dim 1 is 3"),
    Case("positions-over-max-write", lambda s, t: (tok(3), pos(t, 33)), "both are the dynamic size"),
    Case("batch-2", lambda s, t: (tok(3, batch=2), pos(t, 3)), "tokens.*dim 0 must be 1, got 2"),
    Case("batch-0", lambda s, t: (tok(3, batch=0), pos(t, 3)), "dim 0 must be 1, got 0"),
    Case("swapped-order", lambda s, t: (pos(t, 3), tok(3)), "tokens.*must have rank 2"),
    # not tensors at all
    Case("tokens-list", lambda s, t: ([[1, 2, 3]], pos(t, 3)), "tokens.*must be a tensor, got list"),
    Case("tokens-numpy", lambda s, t: (np.zeros((1, 3), dtype=np.int64), pos(t, 3)), "must be a tensor, got ndarray"),
    Case("tokens-none", lambda s, t: (None, pos(t, 3)), "must be a tensor, got NoneType"),
    Case("tokens-and-position-none", lambda s, t: (None, None), "tokens.*must be a tensor, got NoneType"),
    Case("position-range", lambda s, t: (tok(3), range(t, t + 3)), "position.*must be a tensor, got range"),
    Case("position-int", lambda s, t: (tok(1), t), "position.*must be a tensor, got int"),
    # the position input: rank, dtype, device
    Case("position-rank-2", lambda s, t: (tok(3), pos(t, 3)[:, None]), r"position.*must have rank 1.*got shape \(3, 1\)"),
    Case("position-rank-0", lambda s, t: (tok(1), torch.tensor(t)), "position.*must have rank 1"),
    Case("position-int32", lambda s, t: (tok(3), pos(t, 3, torch.int32)), "position.*must be int64, got torch.int32"),
    Case("position-float", lambda s, t: (tok(3), pos(t, 3, torch.float32)), "position.*must be int64"),
    Case("position-wrong-device", lambda s, t: (tok(3), torch.arange(3, device="meta")), "position.*must be on cpu, got meta"),
    # lifecycle
    Case("session-closed", lambda s, t: (tok(3), pos(t, 3)), "session is closed", close=True),
]


@pytest.fixture
def spied(loaded_example):
    """The loaded program under a fresh Artifact whose ``run`` counts its calls."""
    artifact = Artifact(loaded_example.path, loaded_example.specs, loaded_example.methods)
    real = artifact.run
    calls: list[int] = []

    def run(flat_inputs, width=None):
        calls.append(len(flat_inputs))
        return real(flat_inputs, width)

    artifact.run = run  # type: ignore[method-assign]
    return artifact, calls


def advance(session, bundle, n: int, seed: int = 1) -> None:
    """Commit ``n`` real tokens in steps of at most max_write."""
    tokens = tok(n, seed)
    for start in range(0, n, MAX_WRITE):
        session.step(*bundle.make_inputs(tokens[:, start : start + MAX_WRITE], start))
    assert session.committed_length == n


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # bit equality, NaN (never-written rows) included


def test_table_is_large_enough():
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_step_is_refused_before_the_program_runs(spied, example_bundle, case):
    artifact, calls = spied
    session = artifact.new_session()
    advance(session, example_bundle, case.setup)
    if case.close:
        session.close()
    before = session.metrics()
    snap = [t.clone() for t in session.storage.bound()]
    objects = list(session.storage.bound())
    n_runs = len(calls)
    inputs = case.make(session, session.committed_length)

    with pytest.raises(StepRefused, match=case.match):
        session.step(*inputs)

    assert len(calls) == n_runs, "the compiled program ran"
    after = session.metrics()
    assert after.committed_length == before.committed_length == case.setup
    assert (after.steps, after.failed_steps) == (before.steps, 0)
    assert after.refused_steps == before.refused_steps + 1
    assert (after.capacity, after.growth_count) == (before.capacity, before.growth_count)
    now = session.storage.bound()
    assert len(now) == len(objects) and all(a is b for a, b in zip(now, objects))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(now, snap))


def test_valid_step_after_every_refusal_matches_eager(spied, example_bundle, loaded_example):
    artifact, calls = spied
    manifest = loaded_example.specs.manifest
    session = artifact.new_session()
    ref = ReferenceCaches(example_bundle.cache_config, manifest.layer_ids)
    prefix = tok(START, 1)
    session.step(*example_bundle.make_inputs(prefix, 0))
    with torch.no_grad(), ref.activate():
        example_bundle.model(*example_bundle.make_inputs(prefix, 0))

    same_setup = [c for c in CASES if c.setup == START and not c.close]
    for case in same_setup:
        with pytest.raises(StepRefused):
            session.step(*case.make(session, session.committed_length))
    assert len(calls) == 1
    m = session.metrics()
    assert (m.committed_length, m.steps, m.failed_steps, m.refused_steps) == (START, 1, 0, len(same_setup))

    nxt = tok(3, 2)
    (got,) = session.step(*example_bundle.make_inputs(nxt, START))
    with torch.no_grad(), ref.activate():
        want = example_bundle.model(*example_bundle.make_inputs(nxt, START))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert session.committed_length == START + 3 and len(calls) == 2


def test_capacity_boundary_is_exact(spied, example_bundle):
    """At length 250 a step of 6 fills the session exactly; one more token is refused."""
    artifact, calls = spied
    session = artifact.new_session()
    advance(session, example_bundle, 250)
    with pytest.raises(StepRefused, match="7 tokens at length 250"):
        session.step(*example_bundle.make_inputs(tok(7), 250))
    session.step(*example_bundle.make_inputs(tok(6), 250))
    assert session.committed_length == MAX_CAPACITY and session.storage.capacity == MAX_CAPACITY
    n_runs = len(calls)
    with pytest.raises(StepRefused, match="reset the session"):
        session.step(*example_bundle.make_inputs(tok(1), 256))
    assert len(calls) == n_runs
    session.reset()  # a reset session is admitted again, at the same capacity
    session.step(*example_bundle.make_inputs(tok(32), 0))
    assert session.committed_length == 32 and session.storage.capacity == MAX_CAPACITY


def test_admit_step_reads_shapes_only(loaded_example):
    """``admit_step`` alone: the width comes from the spec'd input and dim; contents are never
    read, so values the program would reject (token 999, positions past capacity) still pass."""
    specs = loaded_example.specs
    assert specs.step_width.format() == "0:1"
    assert admit_step(specs, (tok(7), pos(0, 7)), committed_length=0) == 7
    assert admit_step(specs, (tok(32), pos(224, 32)), committed_length=224) == 32
    assert admit_step(specs, (torch.full((1, 5), 999), pos(10_000, 5)), committed_length=0) == 5
    with pytest.raises(StepRefused, match="max capacity"):
        admit_step(specs, (tok(32), pos(225, 32)), committed_length=225)


def test_admission_memo_rechecks_what_changes(loaded_example):
    """A session's ``Admission`` runs the per-input checks once per input signature; the length
    check runs every step, a new shape is checked again, and a refused signature is not kept."""
    from offgraph_export.runtime.admission import Admission

    admit = Admission(loaded_example.specs)
    assert admit((tok(1), pos(0, 1)), 0) == 1
    assert admit((tok(1), pos(9, 1)), MAX_CAPACITY - 1) == 1  # same signature
    with pytest.raises(StepRefused, match="exceeds the max capacity"):
        admit((tok(1), pos(0, 1)), MAX_CAPACITY)  # same signature, length past the bound
    with pytest.raises(StepRefused, match="outside the compiled range"):
        admit((tok(33), pos(0, 33)), 0)
    with pytest.raises(StepRefused, match="outside the compiled range"):
        admit((tok(33), pos(0, 33)), 0)  # refused again, not remembered as admitted
    with pytest.raises(StepRefused, match="must be int64"):
        admit((tok(1), pos(0, 1, torch.int32)), 0)
    assert admit((tok(4), None), 0) == 4  # positions the session supplies
    assert admit((tok(1), pos(3, 1)), 3) == 1
    with pytest.raises(StepRefused, match="input 0 .* must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        admit((tok(1).to_sparse(), pos(3, 1)), 3)  # same shape and dtype, another layout


def test_admission_checks_the_device_index_when_given(loaded_example):
    """With the artifact's device, an input on another device of the same type is refused (on a
    cpu machine only the message can be seen, with a device the inputs are not on)."""
    from offgraph_export.runtime.admission import Admission

    assert Admission(loaded_example.specs, torch.device("cpu"))((tok(1), pos(0, 1)), 0) == 1
    with pytest.raises(StepRefused, match="input 0 .* must be on meta, got cpu"):
        admit_step(loaded_example.specs.model_copy(update={"device": "cpu"}), (tok(1), pos(0, 1)), 0,
                   torch.device("meta"))


def test_positions_may_be_left_to_the_session(loaded_example, example_bundle):
    """``None`` for the positions input: the session supplies them (same outputs as passing the
    right ones, prefill and decode, across a reset); the width input may not be None, and an
    artifact whose positions carry the width cannot take None for them."""
    from offgraph_export.runtime.admission import positions_suppliable

    specs = loaded_example.specs
    assert positions_suppliable(specs)
    assert not positions_suppliable(specs.model_copy(update={"positions_input": specs.step_width.input_index}))
    given, supplied = loaded_example.new_session(), loaded_example.new_session()
    tokens = tok(12, seed=4)
    for start, width in [(0, 7), (7, 1), (8, 1), (9, 3)]:
        chunk = tokens[:, start : start + width]
        want = given.step(*example_bundle.make_inputs(chunk, start))[0]
        got = supplied.step(chunk, None)[0]
        assert torch.equal(got, want), (start, width)
    supplied.reset()
    given.reset()
    assert torch.equal(supplied.step(tokens[:, :2], None)[0], given.step(*example_bundle.make_inputs(tokens[:, :2], 0))[0])
    with pytest.raises(StepRefused, match="tokens.*must be a tensor, got NoneType"):
        supplied.step(None, pos(2, 1))
