"""The runtime owns positions and bounds table indices: a step whose positions skip ahead, rewind or
go negative, or whose token ids fall outside the vocabulary, is refused before launch with the
storage bytes and the committed length unchanged. Several threads, each with its own session on
one loaded artifact, get the same results as running one after the other."""

from __future__ import annotations

import threading

import pytest
import torch

from offgraph_export.errors import StepRefused
from tests.test_runtime_storage import bit_equal

VOCAB = 256


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_specs_record_the_positions_input_and_the_vocabulary_bound(loaded_example):
    specs = loaded_example.specs
    assert specs.positions_input == 1 and specs.inputs[1].name == "position"
    assert specs.inputs[0].index_bound == VOCAB and specs.inputs[1].index_bound is None


def test_compiled_program_clamps_table_indices(loaded_example, example_bundle):
    """The in-graph guard: even a call that bypasses the runtime cannot index past the table."""
    session = loaded_example.new_session()
    good = session.prepare(example_bundle.make_inputs(torch.tensor([[VOCAB - 1, 3]]), 0))
    bad = [torch.tensor([[VOCAB + 1000, 3]]), good.inputs[1]]
    out_bad = loaded_example.run([*bad, *[t.clone() for t in session.storage.bound()]])
    out_good = loaded_example.run([*good.inputs, *[t.clone() for t in session.storage.bound()]])
    assert torch.equal(out_bad[0], out_good[0])  # the id was clamped to the last row


def _positions(start: int, width: int) -> torch.Tensor:
    return torch.arange(start, start + width)


BAD_STEPS = [
    pytest.param(lambda c: (_tokens(3, 1), _positions(c + 1, 3)), "positions", id="skips-ahead"),
    pytest.param(lambda c: (_tokens(3, 1), _positions(c - 2, 3)), "positions", id="rewinds"),
    pytest.param(lambda c: (_tokens(3, 1), _positions(-3, 3)), "positions", id="negative"),
    pytest.param(lambda c: (_tokens(3, 1), torch.tensor([c, c + 2, c + 1])), "positions", id="out-of-order"),
    pytest.param(lambda c: (_tokens(1, 1), _positions(10_000, 1)), "positions", id="past-the-storage"),
    pytest.param(lambda c: (torch.tensor([[5, VOCAB, 7]]), _positions(c, 3)), "outside \\[0, 256\\)", id="token-id-at-vocab"),
    pytest.param(lambda c: (torch.tensor([[5, -1, 7]]), _positions(c, 3)), "outside \\[0, 256\\)", id="negative-token-id"),
    pytest.param(lambda c: (torch.tensor([[2**40]]), _positions(c, 1)), "outside \\[0, 256\\)", id="huge-token-id"),
]


@pytest.mark.parametrize(("make", "message"), BAD_STEPS)
def test_bad_values_are_refused_and_nothing_changes(make, message, loaded_example, example_bundle):
    session = loaded_example.new_session(poison=True)
    session.step(*example_bundle.make_inputs(_tokens(20, 0), 0))
    committed = session.committed_length
    before = [t.clone() for t in session.storage.bound()]
    with pytest.raises(StepRefused, match=message):
        session.step(*make(committed))
    assert session.committed_length == committed
    assert all(bit_equal(a, b) for a, b in zip(before, session.storage.bound()))
    assert session.metrics().refused_steps == 1
    # the session goes on as if nothing had happened
    session.step(*example_bundle.make_inputs(_tokens(2, 9), committed))
    assert session.committed_length == committed + 2


def test_positions_in_t1_layout_and_the_right_ones_pass(loaded_example, example_bundle):
    session = loaded_example.new_session()
    session.step(*example_bundle.make_inputs(_tokens(4, 0), 0))
    session.step(_tokens(1, 2), torch.tensor([4]))
    assert session.committed_length == 5


def test_reset_starts_positions_over(loaded_example, example_bundle):
    session = loaded_example.new_session()
    session.step(*example_bundle.make_inputs(_tokens(6, 0), 0))
    with pytest.raises(StepRefused, match="reset the session"):
        session.step(*example_bundle.make_inputs(_tokens(2, 0), 0))
    session.reset()
    session.step(*example_bundle.make_inputs(_tokens(2, 0), 0))
    assert session.committed_length == 2


@pytest.fixture(scope="module")
def cuda_example(tmp_path_factory):
    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_and_lower
    from offgraph_export.runtime import Artifact
    from tests.conftest import EXAMPLE

    bundle = load_bundle(EXAMPLE)
    path, _, _ = export_and_lower(bundle, tmp_path_factory.mktemp("cuda") / "tiny.pt2", device="cuda")
    return Artifact.load(path), bundle


@pytest.mark.cuda
def test_cuda_prepare_reads_no_device_values(cuda_example):
    """On cuda neither positions nor token ids are read (that would sync per step): prepare runs
    under sync-debug mode "error", which raises on any device-to-host synchronization."""
    artifact, bundle = cuda_example
    session = artifact.new_session()
    session.step(*bundle.make_inputs(_tokens(8, 0).cuda(), 0))
    inputs = bundle.make_inputs(_tokens(1, 1).cuda(), 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepared = session.prepare(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert prepared.width == 1


@pytest.mark.cuda
def test_cuda_session_makes_its_own_positions(cuda_example):
    """A wrong device positions tensor is replaced by the session's own: same outputs as right."""
    artifact, bundle = cuda_example
    tokens = _tokens(12, 3).cuda()
    right, wrong = artifact.new_session(), artifact.new_session()
    for start, width in [(0, 5), (5, 1), (6, 6)]:
        chunk = tokens[:, start : start + width]
        want = right.step(chunk, torch.arange(start, start + width, device="cuda"))[0]
        got = wrong.step(chunk, torch.arange(1000, 1000 + width, device="cuda"))[0]
        assert torch.equal(got, want)


@pytest.mark.cuda
def test_cuda_graph_keeps_the_position_itself(cuda_example):
    """CUDA-graph decode advances its own position inside the graph and writes it from the host
    only when the session's length moved otherwise: across prefills between decode steps, growth
    (re-capture), a reset and positions given wrong, None or right, every step's output equals an
    ordinary-launch session's bit for bit."""
    from offgraph_export.runtime import Artifact

    artifact, _ = cuda_example
    graphed_artifact = Artifact.load(artifact.path, single_threaded=True)
    plain, graphed = artifact.new_session(), graphed_artifact.new_session(cuda_graphs=True)
    tokens = _tokens(64, 5).cuda()
    # capacity 16: growths at 17 and 33; decode runs of 1 around prefills of 5, 9 and 3 tokens
    schedule = [5, 1, 1, 1, 9, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    kinds = ["none", "wrong", "right"]
    start = 0
    for i, width in enumerate(schedule):
        chunk = tokens[:, start : start + width]
        want = plain.step(chunk, torch.arange(start, start + width, device="cuda"))[0]
        given = {"none": None, "wrong": torch.arange(900, 900 + width, device="cuda"),
                 "right": torch.arange(start, start + width, device="cuda")}[kinds[i % 3]]
        got = graphed.step(chunk, given)[0]
        assert torch.equal(got, want), (start, width)
        start += width
    metrics = graphed.metrics()
    assert metrics.graph_captures == 3 and metrics.graph_replays == schedule.count(1)
    plain.reset()
    graphed.reset()
    for start in range(3):  # after a reset the position starts over (written from the host)
        want = plain.step(tokens[:, start : start + 1], None)[0]
        assert torch.equal(graphed.step(tokens[:, start : start + 1], None)[0], want)
    graphed.close()  # the graph goes, its counts stay
    assert (graphed.metrics().graph_captures, graphed.metrics().graph_replays) == (3, schedule.count(1) + 3)
    with pytest.raises(StepRefused, match="loaded for capture: load_artifact\\(path, single_threaded=True\\)"):
        artifact.new_session(cuda_graphs=True)  # not loaded with the capturable runner


@pytest.mark.cuda
def test_cuda_greedy_loop_feeds_tokens_from_the_device(cuda_example):
    """``generate`` with CUDA-graph decode queues each step before it reads the token fed to it
    (design section 5): the tokens equal a loop that reads every token on the host before the
    next ordinary-launch step (the graphed and plain steps are bit-equal, see above)."""
    from offgraph_export.generate import generate
    from offgraph_export.runtime import Artifact

    artifact, bundle = cuda_example
    graphed = Artifact.load(artifact.path, single_threaded=True).new_session(cuda_graphs=True)
    prompt = _tokens(7, 11)[0].tolist()
    got = generate(graphed, bundle.make_inputs, prompt, 20)
    plain = artifact.new_session()
    logits = plain.step(*bundle.make_inputs(torch.tensor([prompt], device="cuda"), 0))[0]
    want = []
    for i in range(20):
        want.append(int(logits[0, -1].argmax()))
        if i < 19:
            logits = plain.step(*bundle.make_inputs(torch.tensor([[want[-1]]], device="cuda"), len(prompt) + i))[0]
    assert got.new_tokens == want and len(got.step_ms) == 19
    assert graphed.metrics().graph_replays >= 18 and graphed.committed_length == len(prompt) + 19


@pytest.mark.cuda
def test_cuda_out_of_vocabulary_id_does_not_take_the_process_down(cuda_example):
    artifact, bundle = cuda_example
    session = artifact.new_session()
    out = session.step(torch.tensor([[VOCAB + 5, -7]], device="cuda"), torch.arange(2, device="cuda"))[0]
    torch.cuda.synchronize()  # a device-side assert would surface here
    assert torch.isfinite(out).all()
    other = artifact.new_session()  # and the process still serves other sessions
    other.step(*bundle.make_inputs(_tokens(3, 0).cuda(), 0))
    torch.cuda.synchronize()


# -- concurrency --------------------------------------------------------------------------------


def _run_session(artifact, bundle, seed: int) -> list[torch.Tensor]:
    session = artifact.new_session()
    tokens = _tokens(48, seed)
    outs, start = [], 0
    for width in [9, 1, 14, 1, 1, 20, 1, 1]:
        outs.append(session.step(*bundle.make_inputs(tokens[:, start : start + width], start))[0])
        start += width
    session.close()
    return outs


def test_threads_with_their_own_sessions_match_running_one_after_another(loaded_example, example_bundle):
    seeds = [11, 12, 13, 14]
    solo = {seed: _run_session(loaded_example, example_bundle, seed) for seed in seeds}
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for _ in range(3):  # several rounds, so the threads really interleave
                results[seed] = _run_session(loaded_example, example_bundle, seed)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for seed in seeds:
        assert len(results[seed]) == len(solo[seed])
        for got, want in zip(results[seed], solo[seed]):
            assert torch.equal(got, want), seed


def test_owned_positions_of_a_one_token_step_are_aligned_views(loaded_example):
    """The session's own positions for a one-token step are a dense, 16-byte aligned view of its
    table at any start (the compiled code reads them in place, no copy per step); wider steps
    get the right values too."""
    from offgraph_export.runtime.input_values import InputValues

    values = InputValues(loaded_example.specs, torch.device("cpu"))
    for start in (0, 1, 2, 7, 1001):
        one = values._positions(start, 1)
        assert one.tolist() == [start] and one.is_contiguous() and one.data_ptr() % 16 == 0
    assert values._positions(5, 3).tolist() == [5, 6, 7]
    assert values._positions(0, 0).tolist() == []


def test_the_position_table_is_bounded_whatever_the_archive_claims(loaded_example):
    """The table is sized by the manifest's max_capacity + max_write; an archive may claim 2**31 - 1
    (a 32 GiB table on the first step). It holds at most TABLE_POSITIONS positions, and positions
    past it are still the right ones."""
    from offgraph_export.runtime.input_values import TABLE_POSITIONS, InputValues

    specs = loaded_example.specs
    huge = specs.model_copy(update={"manifest": specs.manifest.model_copy(update={"max_capacity": 2**31 - 1})})
    values = InputValues(huge, torch.device("cpu"))
    assert values._positions(3, 2).tolist() == [3, 4]
    assert values._table is not None and values._table.numel() == 2 * TABLE_POSITIONS
    assert values._positions(TABLE_POSITIONS - 1, 3).tolist() == [TABLE_POSITIONS - 1 + i for i in range(3)]
    assert values._positions(2**31 - 10, 1).tolist() == [2**31 - 10]
    small = InputValues(specs, torch.device("cpu"))
    small._positions(0, 1)
    m = specs.manifest
    assert small._table.numel() == 2 * (m.max_capacity + m.max_write)  # a real manifest's size, as before
