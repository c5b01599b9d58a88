"""The step-width compile spec ``"input_index:dim"``: one strict parser, one formatter."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offgraph_export.errors import SpecError
from offgraph_export.specs import STEP_WIDTH_KEY, StepWidthSpec, format_step_width, parse_step_width

def _valid(text: str) -> bool:
    """The grammar of design section 4.1, written without the parser's regex: two runs of 1-9
    ASCII digits joined by one colon."""
    left, sep, right = text.partition(":")
    return bool(sep) and all(1 <= len(part) <= 9 and all(c in "0123456789" for c in part) for part in (left, right))


def test_key_name():
    assert STEP_WIDTH_KEY == "offgraph_kv_step_width"


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)


@pytest.mark.parametrize(
    ("text", "index", "dim"),
    [
        ("0:1", 0, 1),
        ("12:0", 12, 0),
        ("999999999:999999999", 999_999_999, 999_999_999),
        ("0:0", 0, 0),
        ("007:01", 7, 1),  # leading zeros are still decimal digits
    ],
)
def test_valid(text, index, dim):
    spec = parse_step_width(text)
    assert isinstance(spec, StepWidthSpec)
    assert (spec.input_index, spec.dim) == (index, dim)
    assert spec.format() == f"{index}:{dim}"
    assert str(spec) == spec.format()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1",
        ":0",
        "1:",
        ":",
        "a:0",
        "0:a",
        "-1:0",
        "0:-1",
        "1:0x",
        "0x1:0",
        " 1:0",
        "1:0 ",
        "1 :0",
        "1: 0",
        "+1:0",
        "1:+0",
        "1:0:0",
        "1::0",
        "1,0",
        "1.0:0",
        "1234567890:0",
        "0:1234567890",
        "１:0",  # full-width digit one
        "1:０",  # full-width digit zero
        "١:0",  # Arabic-Indic digit one
        "1:0\n",
        "\n1:0",
        "1:0\x00",
        "1_0:0",
    ],
)
def test_rejected_strings(text):
    with pytest.raises(SpecError) as info:
        parse_step_width(text)
    message = str(info.value)
    assert repr(text) in message, message
    assert STEP_WIDTH_KEY in message


@pytest.mark.parametrize("value", [1, None, b"0:1", 0.5, ["0:1"], ("0", "1")])
def test_rejected_non_strings(value):
    with pytest.raises(SpecError) as info:
        parse_step_width(value)
    message = str(info.value)
    assert repr(value) in message, message
    assert type(value).__name__ in message


@pytest.mark.parametrize(
    ("index", "dim"), [(-1, 0), (0, -1), (1_000_000_000, 0), (0, 1_000_000_000)]
)
def test_format_rejects_out_of_range(index, dim):
    with pytest.raises(SpecError, match=re.escape(repr(f"{index}:{dim}"))):
        format_step_width(index, dim)


def test_format_valid():
    assert format_step_width(0, 1) == "0:1"
    assert format_step_width(999_999_999, 0) == "999999999:0"


def _check_arbitrary(text: str) -> None:
    try:
        spec = parse_step_width(text)
    except ValueError as exc:
        assert str(exc), "rejection must carry a message"
        assert isinstance(exc, SpecError)
        assert not _valid(text), f"valid spec {text!r} refused: {exc}"
        return
    # Any other exception type propagates and fails the test.
    assert _valid(text), text
    left, right = text.split(":")
    assert (spec.input_index, spec.dim) == (int(left), int(right))
    assert parse_step_width(spec.format()) == spec


@given(st.text())
def test_arbitrary_text_parses_strictly_or_raises_value_error(text):
    _check_arbitrary(text)


@given(st.text(alphabet="0123456789:- x", max_size=24))
def test_near_miss_text_parses_strictly_or_raises_value_error(text):
    _check_arbitrary(text)


@given(st.text(alphabet="0123456789", min_size=1, max_size=11), st.text(alphabet="0123456789", min_size=1, max_size=11))
def test_digit_pairs(left, right):
    text = f"{left}:{right}"
    if len(left) <= 9 and len(right) <= 9:
        spec = parse_step_width(text)
        assert (spec.input_index, spec.dim) == (int(left), int(right))
    else:
        with pytest.raises(SpecError):
            parse_step_width(text)


@given(st.integers(0, 999_999_999), st.integers(0, 999_999_999))
def test_round_trip(index, dim):
    text = format_step_width(index, dim)
    assert text == f"{index}:{dim}"
    spec = parse_step_width(text)
    assert (spec.input_index, spec.dim) == (index, dim)
    assert spec.format() == text
    assert parse_step_width(spec.format()) == spec
