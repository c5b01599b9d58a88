"""The step-width compile spec: ``"input_index:dim"``.

The runtime learns how many tokens a step writes from the step's inputs alone: the extent of input
``input_index`` along ``dim``. This module is the single strict parser/formatter of that string.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from offgraph_export.errors import SpecError

__all__ = ["STEP_WIDTH_KEY", "StepWidthSpec", "parse_step_width", "format_step_width"]

STEP_WIDTH_KEY = "offgraph_kv_step_width"

# ASCII digits only (str.isdigit would accept other scripts), 1..9 of them on each side.
_SPEC_RE = re.compile(r"([0-9]{1,9}):([0-9]{1,9})")


class StepWidthSpec(BaseModel):
    """Input ``input_index`` carries the step's token count along dimension ``dim``."""

    model_config = ConfigDict(frozen=True)

    input_index: int = Field(ge=0, le=999_999_999)
    dim: int = Field(ge=0, le=999_999_999)

    def format(self) -> str:
        return format_step_width(self.input_index, self.dim)

    def __str__(self) -> str:
        return self.format()


def parse_step_width(value: object) -> StepWidthSpec:
    """Parse ``"input_index:dim"`` strictly; raise :class:`SpecError` quoting the bad value."""
    if not isinstance(value, str):
        raise SpecError(
            f"{STEP_WIDTH_KEY} must be a string 'input_index:dim', got {type(value).__name__} {value!r}"
        )
    match = _SPEC_RE.fullmatch(value)
    if match is None:
        raise SpecError(
            f"malformed {STEP_WIDTH_KEY} {value!r}: expected 'input_index:dim', two non-negative "
            "decimal integers of 1 to 9 ASCII digits separated by ':' with nothing around them "
            "(for example '0:1')"
        )
    return StepWidthSpec(input_index=int(match.group(1)), dim=int(match.group(2)))


def format_step_width(input_index: int, dim: int) -> str:
    """The one formatter of the spec; raises :class:`SpecError` unless the text parses back."""
    text = f"{input_index}:{dim}"
    parse_step_width(text)
    return text
