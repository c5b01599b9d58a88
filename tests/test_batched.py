"""Many sessions, one step (docs/design.md section 10): the paging contract, the portable paged
step against a plain full recompute, and a batched artifact of the example compiled once and driven
through :class:`BatchedRunner` against every session's own eager model (outputs, the rows each
step writes, joins and leaves, page crossings, ring wraps, failure atomicity, pool exhaustion), the
CLI's ``export --max-sessions``, ``check --sessions`` and ``run`` with several prompts."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from offgraph_export.errors import OffgraphError, SpecError, StepFailed, StepRefused
from offgraph_export.kernels.portable_paged import portable_paged_update_and_attend
from offgraph_export.specs.manifest import paged_row, parse_manifest
from tests.conftest import EXAMPLE, cli

# -- the contract ---------------------------------------------------------------------------------


def _manifest(**paging) -> dict:
    layer = lambda i, w: {"layer_id": i, "window": w, "kv_heads": 2, "head_dim": 16, "v_head_dim": 16,  # noqa: E731
                          "k": {"name": f"k_cache_{i}", "index": 2 + 2 * i}, "v": {"name": f"v_cache_{i}", "index": 3 + 2 * i}}
    base = dict(max_sessions=4, page_size=4, pages_per_session=16, pool_pages=65,
                inputs=[{"name": n, "index": 6 + i} for i, n in enumerate(["token_slots", "token_rows", "page_table", "session_lengths"])])
    base.update(paging)
    return {"version": 2, "storage_dtype": "float32", "batch_size": 1, "max_capacity": 64, "initial_capacity": 16,
            "max_write": 32, "layers": [layer(0, None), layer(1, 16)], "paging": base}


def test_check_lets_a_session_leave_after_crossing_pages_and_wrapping_every_ring():
    from offgraph_export.check import _rows_before_leaving

    with_ring = parse_manifest(json.dumps(_manifest()))
    assert _rows_before_leaving(with_ring) == 16 + 32 - 1 + 1  # the ring of window 16 (max_write 32) wrapped
    flat = _manifest(page_size=8, pages_per_session=8, pool_pages=33)
    flat["layers"][1]["window"] = None
    assert _rows_before_leaving(parse_manifest(json.dumps(flat))) == 3 * 8  # no ring: three pages


def test_paged_manifest_parses_and_its_rules_hold():
    m = parse_manifest(json.dumps(_manifest()))
    assert m.paging.slots == 5 and m.paging.max_pool_pages == 65
    assert m.storage_shape(m.layers[0].k, 9) == (9, 4, 2, 16)  # a pool of 9 pages of 4 rows
    assert m.storage_shape(m.layers[1].k, 9) == (5, 2, 16 + 32 - 1, 16)  # a ring per slot
    assert paged_row([7, 3], 5, 4) == 3 * 4 + 1
    table = torch.tensor([[7, 3], [2, 9]])
    assert paged_row(table, torch.tensor([[0, 5], [7, 4]]), 4).tolist() == [[28, 13], [39, 36]]


@pytest.mark.parametrize("change, message", [
    (dict(page_size=6), "power of two"),
    (dict(pages_per_session=15, pool_pages=61), "ceil\\(max_capacity / page_size\\)"),
    (dict(pool_pages=66), "must lie in \\[2, 65\\]"),
    (dict(pool_pages=1), "greater than or equal to 2"),
    (dict(inputs=[{"name": n, "index": 6 + i} for i, n in enumerate(["token_rows", "token_slots", "page_table", "session_lengths"])]),
     "expected \\['token_slots'"),
    (dict(inputs=[{"name": n, "index": 7 + i} for i, n in enumerate(["token_slots", "token_rows", "page_table", "session_lengths"])]),
     "must follow the storage inputs"),
])
def test_paged_manifest_refusals(change, message):
    with pytest.raises(SpecError, match=message):
        parse_manifest(json.dumps(_manifest(**change)))


def test_paging_needs_version_2_and_version_2_needs_paging():
    one = _manifest()
    one["version"] = 1
    with pytest.raises(SpecError, match="unknown manifest version 1"):
        parse_manifest(json.dumps(one))
    two = _manifest()
    del two["paging"]
    with pytest.raises(SpecError, match="unknown manifest version 2"):
        parse_manifest(json.dumps(two))


# -- the portable paged step against a plain full recompute ------------------------------------


def _plain(q, keys, values, scale):
    """One query ``[Hq, D]`` over its visible history ``[n, Hkv, D]``: softmax attention, GQA."""
    group = q.shape[0] // keys.shape[1]
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    s = torch.einsum("hd,nhd->hn", q.float(), k) * scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3, 9], ids=["flat", "ring-3", "ring-9"])
@pytest.mark.parametrize("seed", range(4))
def test_portable_paged_step_matches_a_plain_recompute(window, seed):
    """Random sessions with random histories, each step a mix of decode tokens, prefill chunks and
    padding; pages shuffled, unwritten rows NaN. Every token's output equals attention over exactly
    its own session's visible positions, and every token's row holds its K/V."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, dv, ps, max_write = 4, 2, 8, 6, 4, 8
    sessions, per_session = 3, 6
    slots = sessions + 1
    ring = (window + max_write - 1) if window else None
    pages = 1 + sessions * per_session
    if window is None:
        k_store = torch.full((pages, ps, hkv, d), float("nan"))
        v_store = torch.full((pages, ps, hkv, dv), float("nan"))
    else:
        k_store = torch.full((slots, hkv, ring, d), float("nan"))
        v_store = torch.full((slots, hkv, ring, dv), float("nan"))
    free = list(range(1, pages))
    rng.shuffle(free)
    table = torch.zeros(slots, per_session, dtype=torch.int32)
    history = {s: ([], []) for s in range(1, slots)}  # slot -> (k rows, v rows) by position
    for step in range(6):
        tokens = []  # (slot, position)
        for s in range(1, slots):
            n = rng.choice([1, 1, 2, 3]) if step else rng.randint(1, 5)
            start = len(history[s][0])
            tokens += [(s, start + i) for i in range(n)]
        tokens += [(0, 0)] * rng.randint(0, 2)  # padding
        t = len(tokens)
        q = torch.randn(1, hq, t, d, generator=gen)
        k = torch.randn(1, hkv, t, d, generator=gen)
        v = torch.randn(1, hkv, t, dv, generator=gen)
        pos = torch.tensor([p for _, p in tokens])
        rows = []
        for s, p in tokens:
            if s and window is None and p // ps >= len([x for x in table[s].tolist() if x]):
                table[s, p // ps] = free.pop()
            rows.append(paged_row(table[s].tolist(), p, ps) if s else 0)
        lengths = torch.zeros(slots, dtype=torch.int32)
        lengths[0] = 1  # the scratch slot holds position 0
        for s, p in tokens:
            if s:
                lengths[s] = max(int(lengths[s]), p + 1)
        out = portable_paged_update_and_attend(
            q, k, v, pos, k_store, v_store, torch.tensor([s for s, _ in tokens], dtype=torch.int32),
            torch.tensor(rows, dtype=torch.int32), table, lengths, window, 0.3, torch.float32)
        for i, (s, p) in enumerate(tokens):
            if not s:
                continue
            history[s][0].append(k[0, :, i].clone())
            history[s][1].append(v[0, :, i].clone())
        for i, (s, p) in enumerate(tokens):
            if not s:
                assert out[0, :, i].isfinite().all()
                continue
            lo = 0 if window is None else max(0, p - window + 1)
            keys = torch.stack(history[s][0][lo : p + 1])
            values = torch.stack(history[s][1][lo : p + 1])
            torch.testing.assert_close(out[0, :, i], _plain(q[0, :, i], keys, values, 0.3), atol=1e-5, rtol=1e-5)
            if window is None:
                stored = k_store.view(-1, hkv, d)[paged_row(table[s].tolist(), p, ps)]
            else:
                stored = k_store[s, :, p % ring]
            assert torch.equal(stored, k[0, :, i])


# -- a compiled batched artifact ---------------------------------------------------------------


@pytest.fixture(scope="module")
def batched_artifact(tmp_path_factory):
    """The example with 4 session slots and pages of 4 rows (layer 0 flat, layer 1 a ring of 16),
    exported through the CLI for cpu with the sessions method (off by default on cpu, where it
    computes what the general method does: here it carries the routing of decode steps)."""
    out = tmp_path_factory.mktemp("batched") / "batched.pt2"
    cli("export", EXAMPLE, "-o", str(out), "--max-sessions", "4", "--page-size", "4", "--decode-sessions")
    return out


@pytest.fixture(scope="module")
def loaded_batched(batched_artifact):
    from offgraph_export.runtime import load_artifact

    return load_artifact(batched_artifact)


def _oracle(bundle, manifest):
    return bundle.oracle(manifest)


def _eager_greedy(bundle, prompt, n):
    """Greedy tokens by a plain full recompute: the eager model over the whole sequence, fresh
    caches every token (no cache reuse at all)."""
    from offgraph_export.reference import ReferenceCaches

    seq = list(prompt)
    out = []
    for _ in range(n):
        ref = ReferenceCaches(bundle.cache_config, [0, 1])
        with torch.no_grad(), ref.activate():
            logits = bundle.model(*bundle.make_inputs(torch.tensor([seq]), 0))
        token = int(logits[0, -1].argmax())
        out.append(token)
        seq.append(token)
    return out


def test_check_batched_passes_with_joins_leaves_page_crossings_and_ring_wraps(loaded_batched, example_bundle):
    from offgraph_export.check import check_batched

    report = check_batched(loaded_batched, example_bundle, sessions=8, seed=1)
    assert report.passed, report.render()
    assert report.sessions == 8 and report.page_crossings >= 2
    ran = {s.method for s in report.steps}
    assert ran == {"model", "sessions"} and any(n.startswith("methods: model ran") for n in report.notes), report.notes
    assert report.ring_wraps == {"1": True}
    assert any(s.kind == "prefill" and s.start > 0 for s in report.steps)  # a chunk after history
    assert max(report.schedule) > 1 and any(s.step_tokens and s.step_tokens > s.width for s in report.steps)


def test_check_batched_catches_a_row_written_into_another_sessions_page(loaded_batched, example_bundle, monkeypatch):
    """The check's oracle is independent of the runner: rows sent one page off are reported."""
    from offgraph_export.check import check_batched
    from offgraph_export.runtime.batched import BatchedRunner

    fill = BatchedRunner._fill

    def shifted(self, feeds, plan, width):
        fill(self, feeds, plan, width)
        if self._steps == 5:  # one step writes its first token's row into the next page
            self._views(width).dev_int[1, 0] += self.paging.page_size
    monkeypatch.setattr(BatchedRunner, "_fill", shifted)
    report = check_batched(loaded_batched, example_bundle, sessions=4, steps=10)
    assert not report.passed
    assert any("changed that no token of the step owns" in p or "were not written" in p for p in report.problems), report.render()


def test_runner_outputs_match_eager_and_leaving_frees_pages(loaded_batched, example_bundle):
    from offgraph_export.runtime.batched import BatchedRunner

    runner = BatchedRunner(loaded_batched)
    manifest = loaded_batched.specs.manifest
    a, b = runner.open(), runner.open()
    oa, ob = _oracle(example_bundle, manifest), _oracle(example_bundle, manifest)
    ta, tb = list(range(3, 30)), list(range(100, 120))
    out = runner.step({a: ta[:9], b: tb[:5]})
    for sid, o, toks in [(a, oa, ta[:9]), (b, ob, tb[:5])]:
        want = o.step(example_bundle.make_inputs(torch.tensor([toks]), 0))[0]
        torch.testing.assert_close(out[sid][0], want, atol=1e-4, rtol=1e-4)
    assert runner.pages(a) and len(runner.pages(a)) == math.ceil(9 / 4)
    assert not set(runner.pages(a)) & set(runner.pages(b)) and 0 not in runner.pages(a)
    free = runner.free_pages
    runner.close(a)
    assert runner.free_pages == free + 3
    with pytest.raises(StepRefused, match="not open"):
        runner.step({a: [1]})


def test_padded_steps_give_each_session_its_own_outputs(loaded_batched, example_bundle):
    """A step padded to a wider width (as a CUDA graph of a captured width pads it: scratch
    tokens of slot 0 at position 0) cuts the outputs per session before the padding and gives
    each session what its eager oracle gives; the padding's outputs reach no one."""
    from offgraph_export.runtime.batched import BatchedRunner

    runner = BatchedRunner(loaded_batched)
    runner._width = lambda total: min(total + 3, loaded_batched.specs.manifest.max_write)  # pad as a graph would
    manifest = loaded_batched.specs.manifest
    a, b = runner.open(), runner.open()
    oracles = {a: _oracle(example_bundle, manifest), b: _oracle(example_bundle, manifest)}
    fed = {a: 0, b: 0}
    for feeds in ({a: [5, 6, 7], b: [9]}, {a: [8], b: [10]}, {b: [11, 12], a: [13]}):
        out = runner.step(feeds)
        assert list(out) == list(feeds)
        for sid, toks in feeds.items():
            want = oracles[sid].step(example_bundle.make_inputs(torch.tensor([toks]), fed[sid]))[0]
            assert out[sid][0].shape == want.shape, (sid, out[sid][0].shape, want.shape)
            torch.testing.assert_close(out[sid][0], want, atol=1e-4, rtol=1e-4)
            fed[sid] += len(toks)
    assert runner.metrics().padded_tokens == 9 and runner.length(a) == 5 and runner.length(b) == 4


def test_step_inputs_are_aligned_disjoint_regions_of_one_staging_buffer(loaded_batched):
    """Every width's token, slot and row inputs and the sessions' lengths are views of the one
    device staging buffer that a step copies whole: 16-byte aligned (compiled kernels assume it),
    no two overlapping, and after a step the device buffer holds what the host filled."""
    from offgraph_export.runtime.batched import BatchedRunner
    from offgraph_export.specs.manifest import BATCH_INPUTS

    runner = BatchedRunner(loaded_batched)
    staged = runner._dev_staged
    lo, hi = staged.data_ptr(), staged.data_ptr() + staged.numel()
    names = ["tokens", "positions", *BATCH_INPUTS]
    for width in range(1, loaded_batched.specs.manifest.max_write + 1):
        model_inputs = runner._inputs(width)
        n_model = len(model_inputs) - len(runner.storage) - len(BATCH_INPUTS)
        views = dict(zip(names, [*model_inputs[:n_model], *model_inputs[-len(BATCH_INPUTS):]]))
        spans = []
        for name, view in views.items():
            assert view.data_ptr() % 16 == 0, (width, name)
            if name == "page_table":
                continue  # its own buffer: only the rows that changed are copied
            end = view.data_ptr() + view.numel() * view.element_size()
            assert lo <= view.data_ptr() and end <= hi, (width, name)
            spans.append((view.data_ptr(), end, name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            assert end <= start, (width, a, b)
    sid = runner.open()
    runner.step({sid: [3, 4, 5]})
    assert torch.equal(staged.cpu(), runner._host_staged)


def test_a_one_token_step_goes_in_at_the_width_the_program_was_compiled_from(loaded_batched, example_bundle):
    """Without a decode method the general program (compiled for 2 or more tokens, design section
    4.3) takes a step of one token beside one scratch token: one padding token per such step,
    and the session's outputs are still its eager oracle's."""
    from offgraph_export.runtime.batched import BatchedRunner
    from offgraph_export.specs.artifact import STEP_METHOD

    assert loaded_batched.method_for(1) == STEP_METHOD and loaded_batched.general_min_width == 2
    runner = BatchedRunner(loaded_batched)
    a = runner.open()
    oracle = _oracle(example_bundle, loaded_batched.specs.manifest)
    fed = 0
    for toks in ([5, 6, 7], [8], [9], [10, 11], [12]):
        out = runner.step({a: toks})
        want = oracle.step(example_bundle.make_inputs(torch.tensor([toks]), fed))[0]
        assert out[a][0].shape == want.shape
        torch.testing.assert_close(out[a][0], want, atol=1e-4, rtol=1e-4)
        fed += len(toks)
    assert runner.metrics().padded_tokens == 3 and runner.length(a) == 8


def test_decode_steps_of_several_sessions_run_the_sessions_method(loaded_batched, example_bundle):
    """A step of one token a session goes to the sessions method (padded or not), any step with a
    longer feed to the general one; outputs are each session's eager oracle's either way."""
    from offgraph_export.runtime.batched import BatchedRunner
    from offgraph_export.specs.artifact import SESSIONS_METHOD, STEP_METHOD

    assert loaded_batched.specs.methods == [STEP_METHOD, SESSIONS_METHOD] and loaded_batched.specs.sessions_method
    assert loaded_batched.method_for(3, one_row_per_session=True) == SESSIONS_METHOD
    assert loaded_batched.method_for(3) == STEP_METHOD
    runner = BatchedRunner(loaded_batched)
    manifest = loaded_batched.specs.manifest
    sids = [runner.open() for _ in range(3)]
    oracles = {sid: _oracle(example_bundle, manifest) for sid in sids}
    fed = dict.fromkeys(sids, 0)
    steps = [({sids[0]: [3, 4], sids[1]: [5], sids[2]: [6, 7, 8]}, STEP_METHOD)]
    steps += [({sid: [10 + 3 * i + j] for j, sid in enumerate(sids)}, SESSIONS_METHOD) for i in range(6)]
    steps += [({sids[1]: [40]}, SESSIONS_METHOD), ({sids[0]: [41], sids[2]: [42, 43]}, STEP_METHOD)]
    for feeds, method in steps:
        out = runner.step(feeds)
        assert runner.last_method == method, (feeds, runner.last_method)
        for sid, toks in feeds.items():
            want = oracles[sid].step(example_bundle.make_inputs(torch.tensor([toks]), fed[sid]))[0]
            torch.testing.assert_close(out[sid][0], want, atol=1e-4, rtol=1e-4)
            fed[sid] += len(toks)
    assert runner.metrics().method_steps == {STEP_METHOD: 2, SESSIONS_METHOD: 7}


def test_specs_that_disown_or_invent_the_sessions_method_are_refused(batched_artifact, example_artifact, tmp_path):
    """The sessions method is a batched artifact's: specs claiming it on a single-session
    package, or leaving it out of a package that holds it, are refused at load by name."""
    from offgraph_export.runtime import load_artifact
    from tests.archive_tools import rewrite, specs_edit

    invented = rewrite(example_artifact, tmp_path / "invented.pt2", specs_edit(lambda s: s.update(sessions_method=True)))
    with pytest.raises(OffgraphError, match="only a batched artifact has that method"):
        load_artifact(invented)
    disowned = rewrite(batched_artifact, tmp_path / "disowned.pt2", specs_edit(lambda s: s.update(sessions_method=False)))
    with pytest.raises(OffgraphError, match=r"aotinductor/sessions/.* is not part of an offgraph package"):
        load_artifact(disowned)  # the sessions library is an entry the specs do not account for


@pytest.mark.parametrize("sessions_method", [False, True], ids=["general", "sessions-method"])
def test_a_failed_step_commits_nothing_for_anyone(tmp_path, sessions_method):
    """A real failure inside the compiled program (``tiny_models.GuardedTokens``): every session's
    length, pages and storage bytes are as before the step, and the next step proceeds; with the
    sessions method the failing step is a decode step of both sessions and runs there."""
    from offgraph_export.pipeline import export_model, lower, run_passes
    from offgraph_export.reference.oracle import ReferenceOracle
    from offgraph_export.runtime import load_artifact
    from offgraph_export.runtime.batched import BatchedRunner
    from offgraph_export.specs import CacheConfig
    from tests import tiny_models

    model = tiny_models.GuardedTokens().eval()
    config = CacheConfig(max_capacity=32, initial_capacity=8, max_write=8, ring_windows={1: 4}, max_sessions=3, page_size=2)
    inputs = (torch.zeros(1, 4, dtype=torch.int64), torch.arange(4))
    ep = export_model(model, inputs, (1, 0), config.max_write)
    program = run_passes(ep, inputs, config, decode_sessions=sessions_method)
    artifact = load_artifact(lower(program, tmp_path / "guarded.pt2", "cpu"))
    assert artifact.specs.sessions_method == sessions_method
    runner = BatchedRunner(artifact, poison=True)
    a, b = runner.open(), runner.open()
    oa, ob = ReferenceOracle(model, program.manifest), ReferenceOracle(model, program.manifest)
    runner.step({a: [1, 2, 3], b: [4]})
    with torch.no_grad():
        oa.step((torch.tensor([[1, 2, 3]]), torch.arange(3)))
        ob.step((torch.tensor([[4]]), torch.arange(1)))
    lengths, pages, free = (runner.length(a), runner.length(b)), (runner.pages(a), runner.pages(b)), runner.free_pages
    snapshot = [t.clone() for t in runner.storage]
    with pytest.raises(StepFailed, match="no session was advanced"):
        if sessions_method:  # a decode step of both sessions
            runner.step({a: [5], b: [61]})
        else:  # b crosses a page: the page it took goes back
            runner.step({a: [5], b: [61, 7]})
    assert runner.last_method == ("sessions" if sessions_method else "model")
    assert (runner.length(a), runner.length(b)) == lengths and (runner.pages(a), runner.pages(b)) == pages
    assert runner.free_pages == free
    same = lambda x, y: torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())  # noqa: E731
    # the failed step may have written rows past each session's length (never read): the committed ones are intact
    for old, new, s in zip(snapshot, runner.storage, program.manifest.storage_inputs()):
        if program.manifest.owner(s)[0].window is None:
            rows = [paged_row(pages[0], p, 2) for p in range(3)] + [paged_row(pages[1], 0, 2)]
            assert same(old.view(-1, *old.shape[2:])[rows], new.view(-1, *new.shape[2:])[rows])
    m = runner.metrics()
    assert (m.steps, m.failed_steps) == (1, 1)
    out = runner.step({a: [5], b: [6, 7]})
    with torch.no_grad():
        want_a = oa.step((torch.tensor([[5]]), torch.arange(3, 4)))[0]
        want_b = ob.step((torch.tensor([[6, 7]]), torch.arange(1, 3)))[0]
    torch.testing.assert_close(out[a][0], want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[b][0], want_b, atol=1e-4, rtol=1e-4)


def test_pool_exhaustion_is_one_line_naming_the_pool(loaded_batched):
    from offgraph_export.runtime.batched import BatchedRunner, PoolExhausted

    runner = BatchedRunner(loaded_batched, pool_pages=4)  # the scratch page and 3 more
    a, b = runner.open(), runner.open()
    runner.step({a: list(range(8))})  # 2 pages
    with pytest.raises(PoolExhausted) as info:
        runner.step({a: [1] * 4, b: [2] * 8})  # a needs 1 more page, b 2: 3 > 1 free
    message = str(info.value)
    assert "pool of 4 pages of 4 rows has 1 free" in message and len(message.splitlines()) == 1
    assert runner.length(a) == 8 and runner.length(b) == 0 and runner.free_pages == 1
    runner.step({a: [1] * 4})  # what fits still runs
    with pytest.raises(OffgraphError, match="pool_pages=1 must be an int in \\[2, 257\\]"):
        BatchedRunner(loaded_batched, pool_pages=1)


def test_admission_refuses_without_changing_anything(loaded_batched):
    from offgraph_export.runtime.batched import BatchedRunner

    runner = BatchedRunner(loaded_batched)
    a = runner.open()
    # one-token feeds take the runner's short path: each refusal there too (bool and float are no ids)
    cases = [({a: [256]}, "token 256 is outside \\[0, 256\\)"), ({a: [-1]}, "token -1 is outside"),
             ({a: [True]}, "token True is outside"), ({a: [1.0]}, "token 1.0 is outside"),
             ({a: [3, False]}, "token False is outside"), ({a: list(range(33))}, "at most 32"), ({}, "at least one session"),
             ({a: []}, "at least one token"), ({a + 99: [1]}, "not open")]
    for feeds, message in cases:
        with pytest.raises(StepRefused, match=message):
            runner.step(feeds)
    assert runner.length(a) == 0 and runner.metrics().steps == 0
    for _ in range(3):
        runner.open()
    with pytest.raises(StepRefused, match="all 4 session slots are taken"):
        runner.open()


def test_generate_batch_gives_each_prompt_its_tokens_alone(loaded_batched, example_bundle):
    """Three prompts together (more prompts than a step's budget holds at once, one joining when
    another leaves) give each the tokens of a plain full recompute of it alone."""
    from offgraph_export.generate import generate_batch
    from offgraph_export.runtime.batched import BatchedRunner

    prompts = [[5, 6, 7], list(range(40, 70)), [200] * 11, [9]]
    results = generate_batch(BatchedRunner(loaded_batched), prompts, 6)
    for prompt, result in zip(prompts, results):
        assert result.new_tokens == _eager_greedy(example_bundle, prompt, 6)


def test_cli_inspect_check_and_run(batched_artifact):
    from offgraph_export.frontends import load_bundle

    inspect = json.loads(cli("inspect", str(batched_artifact), "--json").stdout)
    assert inspect["manifest"]["paging"]["max_sessions"] == 4 and inspect["manifest"]["version"] == 2
    text = cli("inspect", str(batched_artifact)).stdout
    assert "sessions      4 slots, pages of 4 rows" in text
    proc = cli("check", str(batched_artifact), "--model", EXAMPLE, "--sessions", "6", "--json")
    report = json.loads(proc.stdout)
    assert report["passed"] and report["sessions"] == 6
    together = json.loads(cli("run", str(batched_artifact), "--model", EXAMPLE, "--prompt", "Hello", "--prompt",
                              "The capital of France is", "--prompt", "x", "--max-new-tokens", "5", "--json").stdout)
    bundle = load_bundle(EXAMPLE)
    alone = [_eager_greedy(bundle, bundle.encode(p), 5) for p in ["Hello", "The capital of France is", "x"]]
    assert [r["new_tokens"] for r in together] == alone
    refused = cli("check", str(batched_artifact), "--model", EXAMPLE, "--sessions", "0", check=False)
    assert refused.returncode == 2


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["ordinary", "cuda-graphs"])
def test_cuda_batched_check(graphs, tmp_path_factory):
    """The example as a batched cuda artifact (the Triton paged kernels, bf16): every session's
    every step against its own eager model, with ordinary launches and padded CUDA graphs."""
    from offgraph_export.check import check_batched

    out = tmp_path_factory.getbasetemp() / "batched_cuda.pt2"
    if not out.exists():
        cli("export", EXAMPLE, "-o", str(out), "--device", "cuda", "--dtype", "bfloat16", "--max-sessions", "4", "--page-size", "4")
    from offgraph_export.frontends import load_bundle
    from offgraph_export.models import cast_bundle

    report = check_batched(str(out), cast_bundle(load_bundle(EXAMPLE), "bfloat16"), sessions=8, cuda_graphs=graphs)
    assert report.passed, report.render()


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["ordinary", "cuda-graphs"])
def test_cuda_batched_check_of_a_transformers_llama(graphs, tmp_path_factory):
    """A tiny transformers Llama as a batched cuda artifact: its sessions method takes the rotary
    embedding into the attention kernel with one row per token (passes/decode_rope.py), so every
    session's every decode step checks that fold against the eager model's own rotary code."""
    transformers = pytest.importorskip("transformers")
    from offgraph_export.check import check_batched
    from offgraph_export.frontends import load_bundle
    from offgraph_export.models import cast_bundle
    from tests.test_frontend_hf import COMMON

    base = tmp_path_factory.getbasetemp()
    checkpoint, out = base / "hf_llama_batched", base / "hf_llama_batched_cuda.pt2"
    if not out.exists():
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(checkpoint)
        cli("export", f"hf:{checkpoint}", "-o", str(out), "--device", "cuda", "--dtype", "bfloat16",
            "--max-capacity", "128", "--max-write", "32", "--max-sessions", "4", "--page-size", "4")
    specs = json.loads(cli("inspect", str(out), "--json").stdout)
    assert specs["sessions_method"], specs
    report = check_batched(str(out), cast_bundle(load_bundle(f"hf:{checkpoint}"), "bfloat16"), sessions=8, cuda_graphs=graphs)
    assert report.passed, report.render()
    assert "sessions ran" in report.render()
