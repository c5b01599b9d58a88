"""The CLI's option choices are the library's own: ``cli/main.py`` reads them from
``options.py`` (which imports no torch, so the CLI starts without it); this pins each to its one
definition and the step implementations' registry to the same names."""

from __future__ import annotations

from typing import get_args

import pytest

from offgraph_export.cli.main import cli
from offgraph_export.options import AUTOTUNE_CHOICES, BACKENDS, DEVICES, FORMATS, STEP_IMPLS
from offgraph_export.specs.manifest import StorageDtype


@pytest.mark.parametrize(("option", "defined"), [
    ("step_impl", STEP_IMPLS),
    ("fmt", FORMATS),
    ("executorch_backend", BACKENDS),
    ("max_autotune", AUTOTUNE_CHOICES),
    ("dtype", get_args(StorageDtype)),
    ("device", DEVICES),
])
def test_export_choices_are_the_library_definitions(option, defined):
    (param,) = [p for p in cli.commands["export"].params if p.name == option]
    assert tuple(param.type.choices) == tuple(defined)


@pytest.mark.parametrize("option", ["steps", "prefill_chunks"])
def test_check_step_bounds_are_the_library_bound(option):
    """``check``'s step counts are bounded (a ring-only artifact bounds no schedule by its
    capacity) by the library's one bound, written out for the CLI."""
    from offgraph_export.check import MAX_CHECK_STEPS

    (param,) = [p for p in cli.commands["check"].params if p.name == option]
    assert (param.type.min, param.type.max) == (1, MAX_CHECK_STEPS)
