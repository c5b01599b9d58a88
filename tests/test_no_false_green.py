"""Issue 25, a false green: ``check`` (and ``run``) exit 0 only when the report is complete,
whatever the model's code does. A model file that ends the process early (``os._exit(0)`` while it
is imported, inside ``build()``, an uncaught ``sys.exit(0)`` from its forward, a signal) makes the
command exit nonzero with one line ``error: check did not complete: ...``; the parent, which runs
no user code, gives the verdict (``offgraph_export/cli/verdict.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offgraph_export.cli import verdict
from tests.conftest import EXAMPLE, ROOT, cli

_WRAP = f"""import os, signal, sys
sys.path.insert(0, {str(ROOT / "examples")!r})
from tiny_llama import build as _build
"""

MODELS = {
    "exit-at-import": _WRAP + "os._exit(0)\ndef build(**kw):\n    return _build(**kw)\n",
    "exit-in-build": _WRAP + "def build(**kw):\n    bundle = _build(**kw)\n    os._exit(0)\n",
    # the factory's own call is guarded (sys.exit there is an error, exit 2); the eager forward's is not
    "sys-exit-in-forward": _WRAP + """import dataclasses, torch
class Leaves(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, *args):
        sys.exit(0)
def build(**kw):
    bundle = _build(**kw)
    return dataclasses.replace(bundle, model=Leaves(bundle.model))
""",
}


def _model(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(body)
    return f"{path}:build"


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _assert_incomplete(proc, command: str = "check") -> str:
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1, (proc.returncode, proc.stderr, proc.stdout)
    assert len(lines) == 1 and proc.stderr.rstrip().splitlines()[-1] == lines[0], proc.stderr
    assert lines[0].startswith(f"error: {command} did not complete: "), lines[0]
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_that_ends_the_process_early_fails_check(name, tmp_path, example_artifact):
    proc = cli("check", str(example_artifact), "--model", _model(tmp_path, name, MODELS[name]), "--steps", "2", check=False)
    line = _assert_incomplete(proc)
    assert "ended with status 0 before its report" in line and "os._exit" in line, line
    assert "PASSED" not in proc.stdout


def test_json_check_that_ends_early_fails_and_prints_no_report(tmp_path, example_artifact):
    model = _model(tmp_path, "exit-in-build", MODELS["exit-in-build"])
    proc = cli("check", str(example_artifact), "--model", model, "--json", check=False)
    _assert_incomplete(proc)
    assert proc.stdout == ""


def test_sys_exit_0_at_import_is_an_error_not_a_pass(tmp_path, example_artifact):
    """A ``sys.exit(0)`` the loader catches stays what it was: one error line, exit 2."""
    model = _model(tmp_path, "sys-exit-at-import", _WRAP + "sys.exit(0)\n")
    proc = cli("check", str(example_artifact), "--model", model, check=False)
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "called exit(0)" in lines[0], proc.stderr


def test_killed_by_a_signal(tmp_path, example_artifact):
    model = _model(tmp_path, "killed", _WRAP + "def build(**kw):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = cli("check", str(example_artifact), "--model", model, check=False)
    assert "killed by signal 9 (SIGKILL)" in _assert_incomplete(proc)


def test_nonzero_exit_without_a_record(tmp_path, example_artifact):
    model = _model(tmp_path, "exit-3", _WRAP + "def build(**kw):\n    os._exit(3)\n")
    proc = cli("check", str(example_artifact), "--model", model, check=False)
    assert "ended with status 3 before its report" in _assert_incomplete(proc)


def test_run_that_ends_early_fails(tmp_path, example_artifact):
    model = _model(tmp_path, "exit-in-build", MODELS["exit-in-build"])
    proc = cli("run", str(example_artifact), "--model", model, "--tokens", "1,2,3", "--max-new-tokens", "2", check=False)
    _assert_incomplete(proc, "run")


def test_model_code_never_sees_the_channel(tmp_path, example_artifact):
    """The child takes the channel out of its environment before the model file is imported."""
    seen = tmp_path / "seen.txt"
    body = _WRAP + f"open({str(seen)!r}, 'w').write(repr(os.environ.get({verdict.ENV!r})))\n" \
        "def build(**kw):\n    return _build(**kw)\n"
    proc = cli("check", str(example_artifact), "--model", _model(tmp_path, "peek", body), "--steps", "2", check=False)
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text() == "None"


# -- a normal check is unchanged --------------------------------------------------------------------


def test_check_still_passes_and_prints_its_report(example_artifact):
    proc = cli("check", str(example_artifact), "--model", EXAMPLE, "--steps", "4")
    assert proc.returncode == 0
    assert "PASSED" in proc.stdout and "did not complete" not in proc.stderr
    assert f"checking {example_artifact} against {EXAMPLE} on cpu" in proc.stderr


def test_check_json_still_parses(example_artifact):
    proc = cli("check", str(example_artifact), "--model", EXAMPLE, "--steps", "4", "--json")
    data = json.loads(proc.stdout)
    assert data["passed"] is True and data["model"] == EXAMPLE


def test_usage_errors_are_the_parents(example_artifact):
    """Bad options are refused before any child starts: one line, exit 2, as before."""
    for argv, message in [
        (["check", str(example_artifact), "--steps", "0", "--model", EXAMPLE], "--steps"),
        (["check", str(example_artifact)], "--model"),
        (["check", str(example_artifact), "--model", EXAMPLE, "--sessions", "2"], "one session per program"),
        (["run", str(example_artifact), "--model", EXAMPLE], "exactly one of"),
    ]:
        proc = cli(*argv, check=False)
        lines = _error_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


# -- the record and the verdict ---------------------------------------------------------------------

TOKEN = "ab" * 32


def _record(**fields) -> str:
    return json.dumps({"token": TOKEN, "complete": True, "passed": True, "exit_code": 0} | fields) + "\n"


def test_a_record_counts_only_with_the_token():
    assert verdict._parse(_record(), TOKEN)["complete"] is True
    assert verdict._parse(_record(token="cd" * 32), TOKEN) is None
    assert verdict._parse(_record(token=None), TOKEN) is None
    assert verdict._parse(_record() + _record(), TOKEN) is None  # one record, nothing else
    assert verdict._parse("", TOKEN) is None
    assert verdict._parse("{not json", TOKEN) is None
    assert verdict._parse(_record(exit_code="0"), TOKEN) is None


@pytest.mark.parametrize(("status", "record", "code", "says"), [
    (0, {"complete": True, "passed": True, "exit_code": 0}, 0, None),
    (1, {"complete": True, "passed": False, "exit_code": 1}, 1, None),
    (2, {"complete": False, "passed": False, "exit_code": 2}, 2, None),  # the child said why
    (0, None, 1, "ended with status 0 before its report"),
    (5, None, 1, "ended with status 5 before its report"),
    (-9, None, 1, "killed by signal 9 (SIGKILL)"),
    (-11, {"complete": True, "passed": True, "exit_code": 0}, 1, "killed by signal 11 (SIGSEGV)"),
    (0, {"complete": False, "passed": False, "exit_code": 0}, 1, "ended with status 0 before its report"),
    (0, {"complete": True, "passed": False, "exit_code": 1}, 1, "ended with status 0, but its report with status 1"),
    (3, {"complete": True, "passed": True, "exit_code": 0}, 1, "ended with status 3, but its report with status 0"),
    (0, {"complete": True, "passed": False, "exit_code": 0}, 1, "passed=False with status 0"),
])
def test_verdict(status, record, code, says):
    got, line = verdict.verdict("check", status, record)
    assert got == code
    if says is None:
        assert line is None
    else:
        assert line.startswith("error: check did not complete: ") and says in line, line
