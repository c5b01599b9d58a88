"""Sessions over the compiled example (layer 0 flat, layer 1 ring of 16; capacity 16 -> 256,
max_write 32), with the eager model over reference caches as the oracle: step outputs, growth,
commit only on success (real failures), reset, interleaved sessions, metrics, close, generate."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from offgraph_export.errors import CacheOverflowError, OffgraphError, StepFailed, StepRefused
from offgraph_export.generate import generate
from offgraph_export.reference import ReferenceCaches
from offgraph_export.runtime import Artifact, Session, default_allocator

ATOL = RTOL = 1e-4  # float32 model (check.TOLERANCES)


class Oracle:
    """The eager model over its own reference caches: one per simulated session."""

    def __init__(self, bundle, manifest) -> None:
        self.bundle = bundle
        self.ref = ReferenceCaches(bundle.cache_config, manifest.layer_ids)
        self.used = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.ref.activate():
            out = self.bundle.model(*self.bundle.make_inputs(tokens, self.used))
        self.used += tokens.shape[1]
        return out


def tokens_for(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def chunks(tokens: torch.Tensor, schedule):
    start = 0
    for width in schedule:
        yield start, tokens[:, start : start + width]
        start += width
    assert start == tokens.shape[1]


def run_solo(session: Session, bundle, tokens, schedule) -> list[torch.Tensor]:
    return [session.step(*bundle.make_inputs(chunk, start))[0] for start, chunk in chunks(tokens, schedule)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def snapshot(session: Session) -> list[torch.Tensor]:
    return [t.clone() for t in session.storage.bound()]


def same_storage(session: Session, snap: list[torch.Tensor]) -> bool:
    now = session.storage.bound()
    return len(now) == len(snap) and all(torch.equal(bits(a), bits(b)) for a, b in zip(now, snap))


# growths at 25 (16 -> 32), 35 (-> 64) and 69 (-> 128); the ring (47 rows) wraps after 47 tokens
SCHEDULE = [5, 20, 10, 14] + [1] * 20


def test_steps_match_eager_across_growths(loaded_example, example_bundle):
    session = loaded_example.new_session()
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    tokens = tokens_for(0, sum(SCHEDULE))
    capacities = []
    for start, chunk in chunks(tokens, SCHEDULE):
        (got,) = session.step(*example_bundle.make_inputs(chunk, start))
        want = oracle.step(chunk)
        assert got.shape == want.shape == (1, chunk.shape[1], 256)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"step at {start}: {m}")
        assert session.committed_length == start + chunk.shape[1]
        capacities.append(session.storage.capacity)
    assert capacities[:4] == [16, 32, 64, 64]
    assert capacities[-1] == 128
    assert session.storage.growth_count == 3
    assert session.committed_length > 16 + 32 - 1  # the ring layer wrapped


def test_prepare_run_commit_is_step(loaded_example, example_bundle):
    """The three phases used separately (as the check does) give the same as ``step``."""
    tokens = tokens_for(1, 40)
    a, b = loaded_example.new_session(), loaded_example.new_session()
    for start, chunk in chunks(tokens, [30, 10]):
        inputs = example_bundle.make_inputs(chunk, start)
        prepared = a.prepare(inputs)
        assert prepared.width == chunk.shape[1]
        out_a = a.run(prepared)
        assert a.committed_length == start  # nothing committed yet
        a.commit(prepared)
        out_b = b.step(*inputs)
        assert torch.equal(out_a[0], out_b[0])
    assert a.metrics() == b.metrics()


def test_strided_inputs_are_read_correctly(loaded_example, example_bundle):
    """AOTI does not check strides: the session hands the program contiguous inputs."""
    tokens = tokens_for(2, 12)
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    session = loaded_example.new_session()
    wide = torch.zeros(1, 24, dtype=torch.int64)
    wide[:, ::2] = tokens
    positions = torch.zeros(24, dtype=torch.int64)
    positions[::2] = torch.arange(12)
    strided_tokens, strided_pos = wide[:, ::2], positions[::2]
    assert not strided_tokens.is_contiguous() and not strided_pos.is_contiguous()
    (got,) = session.step(strided_tokens, strided_pos)
    torch.testing.assert_close(got, oracle.step(tokens), atol=ATOL, rtol=RTOL)
    (got,) = session.step(*example_bundle.make_inputs(tokens_for(3, 4), 12))
    torch.testing.assert_close(got, oracle.step(tokens_for(3, 4)), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("bad_width", [2, 12], ids=["no-growth", "with-growth"])
def test_failed_run_commits_nothing_and_next_step_proceeds(guarded, bad_width):
    """A real failure inside the compiled program: a runtime assert the program carries (see
    ``tiny_models.Guarded``) fails for this step's inputs."""
    artifact, model, config = guarded
    session = artifact.new_session()
    ref = ReferenceCaches(config, [0, 1])
    xs = torch.randn(1, 30, 32, generator=torch.Generator().manual_seed(bad_width))
    ok, fail = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)

    def eager(start, width):
        with torch.no_grad(), ref.activate():
            return model(xs[:, start : start + width], torch.arange(start, start + width), ok)

    torch.testing.assert_close(session.step(xs[:, :6], torch.arange(6), ok)[0], eager(0, 6), atol=ATOL, rtol=RTOL)
    with pytest.raises(StepFailed, match="not advanced") as info:
        session.step(xs[:, 6 : 6 + bad_width], torch.arange(6, 6 + bad_width), fail)
    assert "Expected" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)  # the program's own error, chained
    m = session.metrics()
    assert (m.committed_length, m.steps, m.failed_steps, m.refused_steps) == (6, 1, 1, 0)
    # storage was prepared for the failed step (it may have grown), but nothing was committed
    assert m.capacity == (8 if bad_width == 2 else 18)

    # the next good steps continue at 6 as if the failure never happened
    start = 6
    for width in [7, 1, 1, 1]:
        got = session.step(xs[:, start : start + width], torch.arange(start, start + width), ok)[0]
        torch.testing.assert_close(got, eager(start, width), atol=ATOL, rtol=RTOL)
        start += width
    m = session.metrics()
    assert (m.committed_length, m.steps, m.failed_steps) == (16, 5, 1)


def test_growth_failure_in_session_refuses_and_keeps_cache(loaded_example, example_bundle):
    calls = []

    def allocator(shape, dtype, device):
        calls.append(shape)
        if len(calls) == 6:  # 4 at open; the growth allocates k then v of the flat layer
            torch.empty(2**60, dtype=dtype, device=device)  # a real out-of-memory error
        return default_allocator(shape, dtype, device)

    session = loaded_example.new_session(allocator=allocator)
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    tokens = tokens_for(6, 30)
    session.step(*example_bundle.make_inputs(tokens[:, :12], 0))
    oracle.step(tokens[:, :12])
    objects = list(session.storage.bound())
    snap = snapshot(session)

    with pytest.raises(StepRefused, match="could not grow storage to 22 tokens.*can't allocate memory"):
        session.step(*example_bundle.make_inputs(tokens[:, 12:22], 12))
    assert len(calls) == 6
    m = session.metrics()
    assert (m.committed_length, m.capacity, m.growth_count) == (12, 16, 0)
    assert (m.steps, m.failed_steps, m.refused_steps) == (1, 0, 1)
    assert all(a is b for a, b in zip(session.storage.bound(), objects))
    assert same_storage(session, snap)

    # the allocator recovers: the same step now grows and matches eager, and so do later ones
    for start, chunk in chunks(tokens[:, 12:], [10, 8]):
        (got,) = session.step(*example_bundle.make_inputs(chunk, 12 + start))
        torch.testing.assert_close(got, oracle.step(chunk), atol=ATOL, rtol=RTOL)
    assert session.storage.capacity == 32 and session.storage.growth_count == 1


def test_reset_keeps_storage_and_forgets_history(loaded_example, example_bundle):
    poisoned = loaded_example.new_session(poison=True)
    run_solo(poisoned, example_bundle, tokens_for(6, 40), [32, 8])  # the ring wraps
    poisoned.reset()  # in check mode every row, flat and ring, is NaN again
    assert all(t.isnan().all() for t in poisoned.storage.bound())

    session = loaded_example.new_session()
    first = tokens_for(7, 60)
    run_solo(session, example_bundle, first, [32, 28])  # grows to 64; the ring wraps
    assert session.storage.capacity == 64
    objects = list(session.storage.bound())
    before = session.metrics()

    session.reset()
    m = session.metrics()
    assert m.committed_length == 0
    assert (m.capacity, m.growth_count, m.allocated_bytes) == (64, before.growth_count, before.allocated_bytes)
    assert all(a is b for a, b in zip(session.storage.bound(), objects))

    # a new conversation from position 0 sees none of the old one (stale rows in the flat and
    # ring storage are masked), and matches a fresh eager run
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    second = tokens_for(8, 26)
    for start, chunk in chunks(second, [9, 3, 1, 1, 12]):
        (got,) = session.step(*example_bundle.make_inputs(chunk, start))
        torch.testing.assert_close(got, oracle.step(chunk), atol=ATOL, rtol=RTOL)
    assert session.storage.capacity == 64 and all(a is b for a, b in zip(session.storage.bound(), objects))


SCHED_A = [7, 25, 1, 1, 30, 1, 1, 1]  # grows at 32 (-> 32), 33 (-> 64) and 65 (-> 128)
SCHED_B = [3, 1, 1, 1, 1, 14, 20, 1]  # grows at 21 (-> 32) and 41 (-> 64)


def test_interleaved_sessions_match_solo_runs(loaded_example, example_bundle):
    tokens_a, tokens_b = tokens_for(9, sum(SCHED_A)), tokens_for(10, sum(SCHED_B))
    solo_a = run_solo(loaded_example.new_session(), example_bundle, tokens_a, SCHED_A)
    solo_b = run_solo(loaded_example.new_session(), example_bundle, tokens_b, SCHED_B)

    sa, sb = loaded_example.new_session(), loaded_example.new_session()
    assert sa.artifact is sb.artifact  # one loaded program, one copy of the weights
    out_a, out_b = [], []
    steps_a, steps_b = list(chunks(tokens_a, SCHED_A)), list(chunks(tokens_b, SCHED_B))
    for (start_a, chunk_a), (start_b, chunk_b) in zip(steps_a, steps_b):
        out_a.append(sa.step(*example_bundle.make_inputs(chunk_a, start_a))[0])
        # switching to B copies nothing and does not touch A's storage
        ptrs_a = [t.data_ptr() for t in sa.storage.bound()]
        snap_a = snapshot(sa)
        out_b.append(sb.step(*example_bundle.make_inputs(chunk_b, start_b))[0])
        assert [t.data_ptr() for t in sa.storage.bound()] == ptrs_a
        assert same_storage(sa, snap_a)
        assert not {t.data_ptr() for t in sa.storage.bound()} & {t.data_ptr() for t in sb.storage.bound()}
    # compared at the end: no output is a buffer that a later run reused
    for i, (got, want) in enumerate(zip(out_a, solo_a)):
        assert torch.equal(got, want), f"session A step {i} differs from its solo run"
    for i, (got, want) in enumerate(zip(out_b, solo_b)):
        assert torch.equal(got, want), f"session B step {i} differs from its solo run"
    assert (sa.metrics().growth_count, sb.metrics().growth_count) == (3, 2)

    # and both match eager
    for tokens, sched, outs in ((tokens_a, SCHED_A, out_a), (tokens_b, SCHED_B, out_b)):
        oracle = Oracle(example_bundle, loaded_example.specs.manifest)
        for (_, chunk), got in zip(chunks(tokens, sched), outs):
            torch.testing.assert_close(got, oracle.step(chunk), atol=ATOL, rtol=RTOL)


def test_sessions_share_the_program_not_the_loader(loaded_example):
    """A second Artifact around the same compiled program: sessions need no reload."""
    twin = Artifact(loaded_example.path, loaded_example.specs, loaded_example.methods)
    s1, s2 = loaded_example.new_session(), twin.new_session()
    assert s1.artifact.compiled is s2.artifact.compiled
    assert s1.storage is not s2.storage


def test_load_reports_its_stages(loaded_example):
    """``Artifact.load`` times each stage it ran, in order; one made around loaded methods has none."""
    stages = loaded_example.load_seconds
    assert list(stages) == ["archive", "loader", "cross_check", "weights", "constants"]
    assert all(s >= 0 for s in stages.values()) and sum(stages.values()) > 0
    assert loaded_example.load_s == sum(stages.values())
    twin = Artifact(loaded_example.path, loaded_example.specs, loaded_example.methods)
    assert twin.load_seconds == {} and twin.load_s == 0.0


def test_session_metrics(loaded_example, example_bundle):
    session = loaded_example.new_session()
    ring_rows = 16 + 32 - 1
    per_row = 1 * 2 * 16 * 4  # batch, kv heads, head dim, float32

    def expected_bytes(capacity):
        return 2 * capacity * per_row + 2 * ring_rows * per_row

    m = session.metrics()
    assert m.model_dump() == {
        "committed_length": 0, "capacity": 16, "growth_count": 0, "allocated_bytes": expected_bytes(16),
        "steps": 0, "failed_steps": 0, "refused_steps": 0, "graph_captures": 0, "graph_replays": 0,
        "decode_method_steps": 0,
    }
    tokens = tokens_for(11, 40)
    session.step(*example_bundle.make_inputs(tokens[:, :20], 0))  # -> 32
    bad = tokens[:, 20:22].clone()
    bad[0, 0] = 300  # outside the vocabulary: refused before launch
    with pytest.raises(StepRefused, match=r"holds 300, outside \[0, 256\)"):
        session.step(*example_bundle.make_inputs(bad, 20))
    with pytest.raises(StepRefused, match="expected 2 model inputs"):
        session.step(tokens[:, 20:22])
    session.step(*example_bundle.make_inputs(tokens[:, 20:40], 20))  # -> 64
    m = session.metrics()
    assert (m.committed_length, m.capacity, m.growth_count) == (40, 64, 2)
    assert m.allocated_bytes == expected_bytes(64) == session.storage.allocated_bytes()
    assert (m.steps, m.failed_steps, m.refused_steps) == (2, 0, 2)  # failures: the guarded test


def test_closed_session_refuses_and_releases_storage(loaded_example, example_bundle):
    session = loaded_example.new_session()
    tokens = tokens_for(12, 8)
    session.step(*example_bundle.make_inputs(tokens[:, :4], 0))
    refs = [weakref.ref(t) for t in session.storage.bound()]
    session.close()
    gc.collect()
    assert all(r() is None for r in refs), "close() must drop the storage tensors"
    with pytest.raises(StepRefused, match="closed"):
        session.step(*example_bundle.make_inputs(tokens[:, 4:], 4))
    m = session.metrics()
    assert (m.committed_length, m.allocated_bytes, m.steps, m.refused_steps) == (4, 0, 1, 1)
    # other sessions over the same artifact are unaffected
    other = loaded_example.new_session()
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    torch.testing.assert_close(
        other.step(*example_bundle.make_inputs(tokens, 0))[0], oracle.step(tokens), atol=ATOL, rtol=RTOL
    )


def test_a_step_prepared_before_the_session_moved_on_is_refused(loaded_example, example_bundle):
    """A PreparedStep runs and commits only in the session state it was admitted in: after
    another step's commit, a reset or a close it is refused (nothing runs, nothing is committed),
    and another session refuses it too; running it again after its own failure is allowed."""
    session, other = loaded_example.new_session(), loaded_example.new_session()
    tokens = tokens_for(21, 8)
    session.step(*example_bundle.make_inputs(tokens[:, :4], 0))
    first = session.prepare(example_bundle.make_inputs(tokens[:, 4:5], 4))
    second = session.prepare(example_bundle.make_inputs(tokens[:, 4:5], 4))
    session.run(first)
    session.run(first)  # running again before the commit (a retry) is allowed
    session.commit(first)
    for action in (session.run, session.commit):
        with pytest.raises(StepRefused, match="prepared at length 4: the session has moved on .*length is 5"):
            action(second)
    with pytest.raises(StepRefused, match="moved on"):
        other.run(session.prepare(example_bundle.make_inputs(tokens[:, 5:6], 5)))
    stale = session.prepare(example_bundle.make_inputs(tokens[:, 5:6], 5))
    session.reset()
    with pytest.raises(StepRefused, match="prepared at length 5: the session has moved on .*length is 0"):
        session.run(stale)
    assert session.committed_length == 0 and other.committed_length == 0
    pending = session.prepare(example_bundle.make_inputs(tokens[:, :2], 0))
    session.close()
    for action in (session.run, session.commit):
        with pytest.raises(StepRefused, match="closed"):
            action(pending)
    m = session.metrics()
    assert (m.committed_length, m.steps, m.refused_steps) == (0, 2, 5)


def test_cuda_graphs_on_a_cpu_artifact_are_refused(loaded_example):
    with pytest.raises(StepRefused, match="CUDA graphs need a cuda artifact"):
        loaded_example.new_session(cuda_graphs=True)


def test_generate_matches_eager_greedy(loaded_example, example_bundle):
    prompt = tokens_for(13, 40)[0].tolist()  # longer than max_write: prefilled in two chunks
    new = 30
    result = generate(loaded_example.new_session(), example_bundle.make_inputs, prompt, new)

    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    ids = torch.tensor([prompt])
    for start in range(0, ids.shape[1], 32):
        logits = oracle.step(ids[:, start : start + 32])
    expected = []
    for _ in range(new):
        next_id = int(logits[0, -1].argmax())
        expected.append(next_id)
        if len(expected) == new:
            break
        logits = oracle.step(torch.tensor([[next_id]]))
    assert result.new_tokens == expected
    assert len(result.step_ms) == new - 1


def test_generate_session_state(loaded_example, example_bundle):
    session = loaded_example.new_session()
    seen = []
    result = generate(session, example_bundle.make_inputs, list(range(5)), 4, on_token=seen.append)
    assert seen == result.new_tokens and len(seen) == 4
    assert session.committed_length == 5 + 3  # the last token is returned, not fed
    assert session.metrics().steps == 1 + 3


def test_generate_reports_the_tokens_made_before_a_failed_step(loaded_example, example_bundle):
    """The greedy loop queues the next step before it reads the token that step is fed: when that
    step fails (here the input builder raises at the third decode step), the token already made
    still reaches ``on_token`` and the result before the error is raised, and the session holds
    exactly the steps that ran."""
    session = loaded_example.new_session()
    calls = []

    def make_inputs(tokens, start):
        calls.append(start)
        if len(calls) == 1 + 3:  # one prefill chunk, then the third decode step
            raise RuntimeError("input builder failed")
        return example_bundle.make_inputs(tokens, start)

    seen = []
    with pytest.raises(RuntimeError, match="input builder failed"):
        generate(session, make_inputs, list(range(5)), 8, on_token=seen.append)
    want = generate(loaded_example.new_session(), example_bundle.make_inputs, list(range(5)), 8).new_tokens
    assert seen == want[:3]  # the tokens of the prefill and the two decode steps that ran
    assert session.committed_length == 5 + 2


def test_generate_reserves_what_it_needs_once(loaded_example, example_bundle):
    """40 prompt tokens and 30 new ones write 69 rows: one allocation of exactly 69 rows up
    front instead of growing 16 -> 32 -> 64 -> 128 along the way."""
    session = loaded_example.new_session()
    generate(session, example_bundle.make_inputs, tokens_for(13, 40)[0].tolist(), 30)
    m = session.metrics()
    assert (m.committed_length, m.capacity, m.growth_count) == (69, 69, 1)


def test_reserve_then_steps_match_eager_without_growing(loaded_example, example_bundle):
    session = loaded_example.new_session()
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    tokens = tokens_for(8, 50)
    session.step(*example_bundle.make_inputs(tokens[:, :10], 0))
    oracle.step(tokens[:, :10])
    assert session.reserve(50) and session.storage.capacity == 50  # history copied into 50 rows
    assert not session.reserve(20)
    for start, chunk in chunks(tokens[:, 10:], [32, 1, 7]):
        (got,) = session.step(*example_bundle.make_inputs(chunk, 10 + start))
        torch.testing.assert_close(got, oracle.step(chunk), atol=ATOL, rtol=RTOL)
    assert session.metrics().growth_count == 1 and session.storage.capacity == 50


def test_reserve_refusals(loaded_example):
    session = loaded_example.new_session()
    maximum = loaded_example.specs.manifest.max_capacity
    with pytest.raises(CacheOverflowError, match=f"{maximum + 1} tokens exceed the session's max capacity of {maximum}"):
        session.reserve(maximum + 1)
    for bad in (-1, True, 2.5):
        with pytest.raises(OffgraphError, match="reserve takes a token count >= 0"):
            session.reserve(bad)

    def allocator(shape, dtype, device):
        if shape[2] == 100:
            torch.empty(2**60, dtype=dtype, device=device)  # a real out-of-memory error
        return default_allocator(shape, dtype, device)

    failing = loaded_example.new_session(allocator=allocator)
    with pytest.raises(StepRefused, match="could not reserve storage for 100 tokens .cache unchanged.: .*can't allocate"):
        failing.reserve(100)
    assert failing.storage.capacity == loaded_example.specs.manifest.initial_capacity
    session.close()
    with pytest.raises(StepRefused, match="closed"):
        session.reserve(10)


def test_feed_supplies_positions_and_matches_eager(loaded_example, example_bundle):
    """``feed`` steps tokens at the committed length with the runtime's own positions: a builder
    whose positions are wrong changes nothing (they are never used), and the outputs match the
    eager model over a prefill, a growth and decode steps."""
    session = loaded_example.new_session()
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    tokens = tokens_for(7, 40)

    def wrong_positions(chunk, start):  # the runtime must not read these
        ids, _ = example_bundle.make_inputs(chunk, start)
        return ids, torch.full((chunk.shape[1],), -5, dtype=torch.int64)

    for start, chunk in chunks(tokens, [20, 1, 3, 1, 15]):
        assert session.committed_length == start
        out = session.feed(wrong_positions, chunk)[0]
        torch.testing.assert_close(out, oracle.step(chunk), atol=ATOL, rtol=RTOL)
    assert session.committed_length == 40 and session.metrics().growth_count == 2
    # and with the builder's own (right) positions, the same as step()
    other = loaded_example.new_session()
    outs = [other.feed(example_bundle.make_inputs, chunk)[0] for _, chunk in chunks(tokens, [20, 20])]
    ref = run_solo(loaded_example.new_session(), example_bundle, tokens, [20, 20])
    for a, b in zip(outs, ref):
        assert torch.equal(a, b)


def test_replay_graph_needs_a_captured_graph(loaded_example):
    session = loaded_example.new_session()
    with pytest.raises(StepRefused, match="no captured decode graph"):
        session.replay_graph()


# -- one-token steps run a program compiled for them ---------------------------------------------


def test_a_one_token_step_runs_the_general_program_at_width_two(loaded_example, example_bundle, monkeypatch):
    """Without a decode method (the cpu default) the general program, which AOTInductor compiled
    for 2 or more tokens, takes a one-token step at width 2 with its token repeated (design
    section 4.3): the compiled call sees two tokens and two equal positions, the session gets the
    first token's outputs, which are the eager model's, and storage holds the rows the eager
    caches hold (the repeated token writes its own row, with the same values)."""
    from offgraph_export.specs.artifact import STEP_METHOD

    assert loaded_example.pads_one_token and loaded_example.general_min_width == 2
    compiled = loaded_example._runs[STEP_METHOD]
    calls: list[list[torch.Tensor]] = []

    def spy(inputs):
        calls.append([x.clone() for x in inputs[: len(loaded_example.specs.inputs)]])
        return compiled(inputs)

    monkeypatch.setitem(loaded_example._runs, STEP_METHOD, spy)
    session = loaded_example.new_session()
    oracle = Oracle(example_bundle, loaded_example.specs.manifest)
    tokens = tokens_for(11, 60)  # past the ring's 47 rows: the repeated rows wrap too
    for start, chunk in chunks(tokens, [9] + [1] * 51):
        (got,) = session.step(*example_bundle.make_inputs(chunk, start))
        want = oracle.step(chunk)
        assert got.shape == want.shape == (1, chunk.shape[1], 256)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"step at {start}: {m}")
    width = loaded_example.specs.step_width
    positions = loaded_example.specs.positions_input
    assert [c[width.input_index].shape[width.dim] for c in calls] == [9] + [2] * 51
    assert calls[-1][width.input_index][0].tolist() == [tokens[0, -1].item()] * 2
    assert calls[-1][positions].reshape(-1).tolist() == [59, 59]
    assert session.committed_length == 60 and session.metrics().steps == 52
    # the rows the one-token steps wrote, in every layer, against the oracle's own caches
    from offgraph_export.specs.manifest import storage_row

    stored = session.storage.bound()
    recent = list(range(50, 60))
    for i, layer in enumerate(loaded_example.specs.manifest.layers):
        k, v = stored[2 * i], stored[2 * i + 1]
        rows = [storage_row(p, k.shape[2]) for p in recent]
        want_k, want_v = oracle.ref.layers[layer.layer_id].rows_at(recent)
        torch.testing.assert_close(k[:, :, rows], want_k, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v[:, :, rows], want_v, atol=ATOL, rtol=RTOL)


def test_without_per_token_outputs_a_one_token_step_is_not_padded(loaded_example, example_bundle):
    """Specs that do not record per-token outputs (an earlier export, or a model with an output
    that is not per token) leave the one-token step at width 1, as before, and check says so."""
    from offgraph_export.check import check_artifact

    specs = loaded_example.specs.model_copy(update={"output_width_dims": None})
    plain = Artifact(loaded_example.path, specs, loaded_example.methods)
    assert not plain.pads_one_token
    report = check_artifact(plain, example_bundle, decode_steps=4)
    assert report.passed, report.render()
    assert any("compiled for 2 or more tokens (AOTInductor" in n for n in report.notes), report.notes


def test_output_width_dims_names_the_per_token_dim_or_none():
    """Recorded at export from the program's output shapes: the one dim of each output whose size
    is the step width, or None where an output is not per token (a sum over the tokens, a size
    of its own), which rules the repetition out."""
    from offgraph_export.passes.graph_utils import output_width_dims, user_input_nodes

    class Outputs(torch.nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind

        def forward(self, x):
            if self.kind == "per_token":
                return x * 2, x.transpose(0, 1)
            if self.kind == "summed":
                return x * 2, x.sum(dim=1)
            return x * 2, torch.cat([x, x], dim=1)  # a size of its own: 2T

    t = torch.export.Dim("t", min=1, max=16)
    want = {"per_token": [1, 0], "summed": None, "doubled": None}
    for kind, expected in want.items():
        ep = torch.export.export(Outputs(kind), (torch.randn(1, 4, 3),), dynamic_shapes=({1: t},))
        symbol = str(user_input_nodes(ep)[0].meta["val"].shape[1])
        assert output_width_dims(ep, symbol) == expected, kind
