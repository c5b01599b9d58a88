"""Text from an artifact is printed escaped: a control sequence in the specs' free text (the model
reference and arguments, versions, input names, options) or in an archive member's name reaches
the terminal as visible ``\\xNN``/``\\uNNNN`` text, never as the bytes a terminal acts on, in
``inspect``, ``check``'s report and messages, and the CLI's one-line errors (issue 25)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from offgraph_export.specs.artifact import SPECS_ENTRY, read_artifact_specs
from offgraph_export.specs.text import safe_text
from tests.archive_tools import rewrite, specs_edit
from tests.conftest import ROOT

# -- the helper --------------------------------------------------------------------------------

TABLE = [
    ("", ""),
    ("tiny_llama.py:build", "tiny_llama.py:build"),
    ("2.13.0+cpu", "2.13.0+cpu"),
    ("spaces and 'quotes' and \"doubles\"", "spaces and 'quotes' and \"doubles\""),
    ("back\\slash stays", "back\\slash stays"),
    ("Llama-Ω ünïcödé 漢字 😀", "Llama-Ω ünïcödé 漢字 😀"),  # letters, CJK, emoji: unchanged
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # OSC: retitle the terminal
    ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear the screen, cursor home
    ("FAILED\rcheck PASSED", "FAILED\\x0dcheck PASSED"),  # CR: overwrite the line
    ("a\nb", "a\\x0ab"),  # a newline within a field
    ("a\r\nb", "a\\x0d\\x0ab"),
    ("tab\there", "tab\\x09here"),
    ("bell\x07", "bell\\x07"),
    ("FAIL\b\b\b\bPASS", "FAIL\\x08\\x08\\x08\\x08PASS"),  # backspace
    ("nul\x00", "nul\\x00"),
    ("\x0b\x0c\x1c\x1f", "\\x0b\\x0c\\x1c\\x1f"),
    ("del\x7f", "del\\x7f"),
    ("\x80\x85\x9b31m\x9f", "\\x80\\x85\\x9b31m\\x9f"),  # C1, U+009B a one-character CSI
    ("\xa0nbsp and \xe9", "\xa0nbsp and \xe9"),  # U+00A0 and up are not controls
    ("abc\u202edcba", "abc\\u202edcba"),  # RLO: reorders what the line shows
    ("\u202a\u202b\u202c\u202d\u202e", "\\u202a\\u202b\\u202c\\u202d\\u202e"),
    ("\u2066\u2067\u2068\u2069", "\\u2066\\u2067\\u2068\\u2069"),
    ("\u200e\u200f\u061c", "\\u200e\\u200f\\u061c"),  # bidi marks
    ("line\u2028sep\u2029", "line\\u2028sep\\u2029"),  # line and paragraph separators
    ("lone \udcff surrogate", "lone \\udcff surrogate"),  # a name decoded with surrogateescape
]


@pytest.mark.parametrize(("raw", "shown"), TABLE)
def test_safe_text_table(raw, shown):
    assert safe_text(raw) == shown
    assert safe_text(shown) == shown  # the escaped form is printable: escaping twice changes nothing


def test_safe_text_leaves_no_control_character():
    everything = "".join(map(chr, range(0x3000))) + "\U0001f600"
    shown = safe_text(everything)
    assert "\n" not in shown and "\r" not in shown and "\x1b" not in shown
    bidi = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)}
    left = [c for c in shown if (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in bidi or c in "\u2028\u2029")]
    assert left == []
    assert shown.encode("utf-8")  # no lone surrogate is left to fail the terminal's encoding
    assert safe_text(123) == "123"


# -- a hostile archive -------------------------------------------------------------------------

OSC_TITLE = "\x1b]0;pwned\x07"
FAKE_PASS = "\r\x1b[2Kcheck artifact.pt2 against the eager model on cpu: PASSED"
HOSTILE_MODEL = f"/nonexistent/evil{OSC_TITLE}{FAKE_PASS}\n.py:build"
HOSTILE_VERSION = f"2.13.0{OSC_TITLE}\u202egnp.\x9b31m"
HOSTILE_ARG = f"v{OSC_TITLE}\b\b\bok"
HOSTILE_INPUT = "tok\x1b[31mens"
HOSTILE_OPTION = f"none{OSC_TITLE}"
RAW = [b"\x1b", b"\x07", b"\r", b"\x08", "\u202e".encode(), "\x9b".encode()]


def _hostile_specs(specs: dict) -> None:
    specs["model"] = HOSTILE_MODEL
    specs["model_args"] = {f"n{OSC_TITLE}": HOSTILE_ARG}
    specs["torch_version"] = HOSTILE_VERSION
    specs["step_impl"] = f"portable{OSC_TITLE}"
    specs["inputs"][0]["name"] = HOSTILE_INPUT  # cross-checked at load, which inspect never does
    specs["options"] = {**specs["options"], f"opt{OSC_TITLE}": HOSTILE_OPTION}


def _root(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return next(n for n in z.namelist() if n.endswith(SPECS_ENTRY))[: -len(SPECS_ENTRY)]


@pytest.fixture
def hostile(example_artifact, tmp_path) -> Path:
    """The example with escape sequences in the specs' free text and in one member's name; its
    CRCs are computed afresh and its layout is zipfile's canonical one, so it reads as valid."""
    member = (_root(example_artifact) + f"extra/note{OSC_TITLE}\r\x1b[1A\u202e.txt", b"x")
    path = rewrite(example_artifact, tmp_path / "hostile.pt2", specs_edit(_hostile_specs), extra=[member])
    specs = read_artifact_specs(path, verify_crc=True)  # checksums and layout pass: the text gets through
    assert specs.model == HOSTILE_MODEL and specs.torch_version == HOSTILE_VERSION
    return path


def _cli_bytes(*args: str) -> subprocess.CompletedProcess:
    """The CLI with its output as bytes (text mode would turn a CR into a newline)."""
    return subprocess.run([sys.executable, "-m", "offgraph_export", *args], capture_output=True, cwd=ROOT)


def _no_raw_controls(out: bytes) -> None:
    for raw in RAW:
        assert raw not in out, (raw, out)


def test_inspect_prints_the_hostile_text_escaped(hostile, example_artifact):
    proc = _cli_bytes("inspect", str(hostile))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    _no_raw_controls(out)
    text = out.decode("utf-8")
    for shown in (safe_text(HOSTILE_MODEL), safe_text(HOSTILE_VERSION), safe_text(HOSTILE_ARG),
                  safe_text(f"n{OSC_TITLE}"), safe_text(HOSTILE_INPUT), safe_text(HOSTILE_OPTION),
                  safe_text(f"portable{OSC_TITLE}"), "note\\x1b]0;pwned\\x07\\x0d\\x1b[1A\\u202e.txt"):
        assert shown in text, (shown, text)
    assert "\\x1b]0;pwned\\x07" in text and "\\x9b31m" in text and "\\u202e" in text
    # no field adds a line: the hostile output has the clean one's lines, plus the added member's
    clean = _cli_bytes("inspect", str(example_artifact))
    assert clean.returncode == 0, clean.stderr
    assert out.count(b"\n") == clean.stdout.count(b"\n") + 1
    assert [line.split()[0] for line in text.splitlines()[:4]] == ["artifact", "device", "model", "step"]


def test_inspect_json_is_escaped_and_exact(hostile):
    """``--json`` stays as it is: ``json.dumps`` escapes every control character (and, ASCII
    only, every non-ASCII one), and the values read back exactly."""
    proc = _cli_bytes("inspect", str(hostile), "--json")
    assert proc.returncode == 0, proc.stderr
    _no_raw_controls(proc.stdout)
    assert all(byte < 0x80 for byte in proc.stdout)
    data = json.loads(proc.stdout)
    assert data["model"] == HOSTILE_MODEL and data["torch_version"] == HOSTILE_VERSION
    assert data["model_args"] == {f"n{OSC_TITLE}": HOSTILE_ARG}
    assert data["inputs"][0]["name"] == HOSTILE_INPUT
    assert any(entry["name"].endswith(f"note{OSC_TITLE}\r\x1b[1A\u202e.txt") for entry in data["archive"])


def _error_lines(stderr: bytes) -> list[bytes]:
    return [line for line in stderr.split(b"\n") if line.startswith(b"error: ")]


def test_usage_error_quoting_the_recorded_model_is_escaped_on_one_line(hostile):
    """``check`` without ``--model`` suggests the recorded model in its usage error."""
    proc = _cli_bytes("check", str(hostile))
    assert proc.returncode == 2, proc.stderr
    _no_raw_controls(proc.stderr)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and proc.stderr.rstrip(b"\n").split(b"\n") == lines, proc.stderr
    assert safe_text(HOSTILE_MODEL).encode() in lines[0]
    assert b"PASSED" not in proc.stdout and proc.stdout == b""


def test_recorded_model_messages_are_escaped(hostile, tmp_path):
    """``--recorded-model`` says what it imports (the recorded reference and arguments, escaped),
    then fails on the file that does not exist, in one escaped line; nothing is imported."""
    proc = _cli_bytes("check", str(hostile), "--recorded-model", "--steps", "1")
    assert proc.returncode == 2, proc.stderr
    _no_raw_controls(proc.stderr)
    _no_raw_controls(proc.stdout)
    text = proc.stderr.decode("utf-8")
    assert f"importing the model recorded in {hostile}: {safe_text(HOSTILE_MODEL)}" in text
    assert "\\x1b]0;pwned\\x07" in text
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and proc.stderr.rstrip(b"\n").split(b"\n")[-1] == lines[0], proc.stderr
    assert b"PASSED" not in proc.stdout


def test_error_message_with_control_characters_is_one_escaped_line(tmp_path):
    """Any message of the error path (here a factory's exception, which the CLI quotes) prints
    with its control characters escaped, on one line."""
    factory = tmp_path / "evil_factory.py"
    factory.write_text(
        "def build():\n"
        "    raise RuntimeError('boom\\x1b]0;pwned\\x07\\x1b[2K\\x08\\x08check x.pt2: PASSED\\x9b\\u202e')\n"
    )
    proc = _cli_bytes("export", f"{factory}:build", "-o", str(tmp_path / "out.pt2"))
    assert proc.returncode == 2, proc.stderr
    _no_raw_controls(proc.stderr)
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and proc.stderr.rstrip(b"\n").split(b"\n")[-1] == lines[0], proc.stderr
    line = lines[0].decode("utf-8")
    assert "boom\\x1b]0;pwned\\x07\\x1b[2K\\x08\\x08check x.pt2: PASSED\\x9b\\u202e" in line, line
    assert not (tmp_path / "out.pt2").exists()


def test_one_line_joins_lines_and_escapes_the_rest():
    """The error path's formatter: a message's line breaks become "; ", a CR or ESC inside a
    line shows escaped, so a message is always one line of visible text."""
    from offgraph_export.cli.main import _one_line

    assert _one_line("plain message") == "plain message"
    assert _one_line("first\n  second\r\nthird\n") == "first; second; third"
    assert _one_line("bad 'x\rcheck PASSED\x1b]0;t\x07'") == "bad 'x\\x0dcheck PASSED\\x1b]0;t\\x07'"
    assert _one_line("a\u2028b\x85c\u202ed") == "a\\u2028b\\x85c\\u202ed"
    assert "\n" not in _one_line("x\n\x1b\n\ny")


def test_check_report_renders_escaped():
    """``check``'s rendered report: the artifact path, the model and problems or notes quoting
    the specs show no control character, and none adds a line or forges the verdict."""
    from offgraph_export.check import CheckReport

    report = CheckReport(
        artifact=f"/tmp/a{OSC_TITLE}.pt2", model=HOSTILE_MODEL, device="cpu", seed=0, schedule=[3, 1],
        problems=[f"input {HOSTILE_INPUT!s} disagrees\r{FAKE_PASS}"], notes=[f"torch {HOSTILE_VERSION}"],
    )
    text = report.render()
    for raw in ("\x1b", "\x07", "\r", "\x08", "\u202e", "\x9b"):
        assert raw not in text, (raw, text)
    lines = text.split("\n")
    assert lines[0].startswith("check /tmp/a\\x1b]0;pwned\\x07.pt2 against ") and lines[0].endswith(": FAILED")
    assert safe_text(HOSTILE_MODEL) in lines[0]
    assert lines[1].startswith("  schedule") and lines[3].startswith("  problem: ") and lines[4].startswith("  note: ")
    assert [line for line in lines if line.startswith("check")] == [lines[0]]  # one verdict, the real one
    assert len(lines) == 6  # header, schedule, growths, one problem, one note, the steps' heading
