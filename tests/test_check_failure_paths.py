"""Two of check's failure paths, on real compiled programs (the session fixtures; no new compile):

* the compiled step's stored K/V rows differ from the oracle's: the example's real compiled step
  runs, then a wrapper adds a known amount to the rows that step wrote in one storage tensor (the
  rows written stay the right ones, the step's output is already computed: only the stored values
  are wrong). The oracle is the planted error itself: the check must fail on that step alone,
  naming that storage, with the error it measures equal to the amount added.
* the compiled step raises: ``tiny_models.Guarded`` carries a runtime assert that fails inside the
  compiled program for a step whose ``fail`` input is set. The check must report that step as
  raising and stop there, with the session committed exactly up to the step before it.
"""

from __future__ import annotations

import math

import pytest
import torch

from offgraph_export.check import check_artifact
from offgraph_export.models import ModelBundle
from offgraph_export.runtime import Artifact
from offgraph_export.specs.manifest import storage_row


def _sharing(artifact: Artifact, cls: type[Artifact], **attrs) -> Artifact:
    """An ``cls`` over ``artifact``'s already-loaded compiled methods and weights (nothing is
    loaded or compiled again; the shared fixture is left as it was)."""
    out = cls(artifact.path, artifact.specs, artifact.methods, artifact.single_threaded, artifact.device)
    for name, value in attrs.items():
        setattr(out, name, value)
    return out


# -- stored rows differ from the oracle's ------------------------------------------------------


class _TamperedRows(Artifact):
    """Runs the real compiled step, then adds ``delta`` to the rows of this step's positions in
    the storage input named ``target``, on the step starting at ``at``."""

    target: str
    delta: float
    at: int
    tampered: list[tuple[int, list[int]]]

    def run(self, flat_inputs, width=None):
        outputs = super().run(flat_inputs, width)
        positions = flat_inputs[self.specs.positions_input].reshape(-1).tolist()
        if positions[0] == self.at:
            manifest = self.specs.manifest
            index = next(s.index for s in manifest.storage_inputs() if s.name == self.target)
            store = flat_inputs[index]
            rows = sorted({storage_row(p, store.shape[2]) for p in positions})
            store[:, :, rows] += self.delta
            self.tampered.append((self.at, rows))
        return outputs


SCHEDULE = [5, 3, 1, 1]  # the tampered step is index 2 (one token at position 8)
TAMPERED_STEP = 2


def _tampered_check(loaded_example, example_bundle, target: str, delta: float):
    artifact = _sharing(loaded_example, _TamperedRows, target=target, delta=delta,
                        at=sum(SCHEDULE[:TAMPERED_STEP]), tampered=[])
    assert loaded_example.specs.positions_input == 1  # the example's (tokens, position)
    report = check_artifact(artifact, example_bundle, schedule=SCHEDULE)
    return report, artifact.tampered


def test_untampered_wrapper_passes(loaded_example, example_bundle):
    """Control: the wrapper itself (adding 0 to the same rows) changes nothing the check sees."""
    report, tampered = _tampered_check(loaded_example, example_bundle, "k_cache_0", 0.0)
    assert tampered == [(8, [8])]
    assert report.passed, report.render()


@pytest.mark.parametrize("target", ["k_cache_0", "v_cache_1"], ids=["flat-k", "ring-v"])
def test_check_fails_when_stored_rows_differ_from_the_oracle(loaded_example, example_bundle, target):
    delta = 0.5
    report, tampered = _tampered_check(loaded_example, example_bundle, target, delta)
    assert tampered == [(8, [8])]  # position 8 is row 8 in both the flat and the ring (47 rows)
    assert report.passed is False
    steps = report.steps
    assert len(steps) == len(SCHEDULE)  # a wrong row is reported, the replay goes on
    assert steps[0].ok and steps[1].ok, report.render()

    bad = steps[TAMPERED_STEP]
    # the error the check measures is the one planted (float32 rounding of x + 0.5 - x aside)
    assert math.isclose(bad.storage_max_err, delta, rel_tol=1e-4), bad.storage_max_err
    assert bad.problems == [f"{target}: stored rows differ from the oracle's K/V by {bad.storage_max_err:.3e}"]
    # the rows written are still exactly the step's; its output was computed before the tampering
    assert all(rows == [8] for rows in bad.rows_written.values())
    assert bad.max_abs_err <= bad.tolerance

    text = report.render()
    assert "FAILED" in text and f"FAIL {TAMPERED_STEP}" in text
    assert f"{target}: stored rows differ from the oracle's K/V by" in text


def test_check_fails_when_stored_rows_hold_an_infinity(loaded_example, example_bundle):
    """The other branch of the stored-row comparison: a non-finite value where the oracle's is
    finite (an inf would make any relative tolerance pass)."""
    report, tampered = _tampered_check(loaded_example, example_bundle, "v_cache_0", math.inf)
    assert tampered == [(8, [8])]
    assert report.passed is False
    bad = report.steps[TAMPERED_STEP]
    assert bad.problems == ["v_cache_0: stored rows hold other non-finite values (inf, NaN) than the eager reference"]
    assert report.steps[0].ok and report.steps[1].ok


# -- the compiled step raises ------------------------------------------------------------------


def _recorded_sessions(monkeypatch) -> list:
    """The sessions ``check`` opens from now on, so a test can look at them after the check."""
    import offgraph_export.check as check_module

    opened: list = []

    class Recording(check_module.Session):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(check_module, "Session", Recording)
    return opened


GUARDED_VOCAB = 64


def _guarded_bundle(model, config, fail_at: int | None) -> ModelBundle:
    """``Guarded`` as a bundle: token ids pick rows of a fixed embedding table, and the step that
    starts at ``fail_at`` sets the ``fail`` input the compiled program asserts on."""
    table = torch.randn(GUARDED_VOCAB, 32, generator=torch.Generator().manual_seed(3))

    def make_inputs(tokens: torch.Tensor, start: int):
        width = tokens.shape[1]
        fail = torch.ones(1, dtype=torch.int64) if start == fail_at else torch.zeros(1, dtype=torch.int64)
        return table[tokens], torch.arange(start, start + width), fail

    return ModelBundle(
        model=model, example_inputs=make_inputs(torch.zeros(1, 5, dtype=torch.int64), 0),
        token_dims=(1, 0, None), cache_config=config, make_inputs=make_inputs, vocab_size=GUARDED_VOCAB,
    )


GUARDED_SCHEDULE = [6, 3, 1, 1]


def test_guarded_check_passes_when_nothing_fails(guarded, monkeypatch):
    """Control: the same bundle with no failing step passes, every step committed."""
    artifact, model, config = guarded
    sessions = _recorded_sessions(monkeypatch)
    report = check_artifact(artifact, _guarded_bundle(model, config, fail_at=None), schedule=GUARDED_SCHEDULE)
    assert report.passed, report.render()
    (session,) = sessions
    assert session.committed_length == sum(GUARDED_SCHEDULE)


@pytest.mark.parametrize("failing", [0, 2], ids=["first-step", "third-step"])
def test_check_reports_a_compiled_step_that_raised_and_commits_nothing_for_it(guarded, failing, monkeypatch):
    artifact, model, config = guarded
    sessions = _recorded_sessions(monkeypatch)
    fail_at = sum(GUARDED_SCHEDULE[:failing])
    report = check_artifact(artifact, _guarded_bundle(model, config, fail_at), schedule=GUARDED_SCHEDULE)

    assert report.passed is False
    assert len(report.steps) == failing + 1  # the replay stops at the step that raised
    assert all(s.ok for s in report.steps[:failing]), report.render()
    bad = report.steps[failing]
    assert bad.start == fail_at and bad.width == GUARDED_SCHEDULE[failing]
    (problem,) = bad.problems
    assert problem.startswith("compiled step raised: ")
    assert "Expected" in problem  # the program's own runtime assert (torch._check), first line only
    assert "\n" not in problem
    assert "compiled step raised: " in report.render()

    # commit only on success: the session holds exactly the steps before the one that raised
    (session,) = sessions
    assert session.committed_length == fail_at
    assert session.metrics().steps == failing
    assert session.closed  # and the check closed it on this path too
