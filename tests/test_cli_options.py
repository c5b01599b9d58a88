"""The CLI's option choices are the library's own: click needs them when the CLI starts, before
torch is imported, so they are written out in ``cli/main.py``; this pins them to the one definition
of each (a new step implementation, format, backend or autotune mode must appear in both)."""

from __future__ import annotations

from typing import get_args

import pytest

from offgraph_export.cli.main import cli
from offgraph_export.lowering.aoti import AUTOTUNE_CHOICES
from offgraph_export.lowering.executorch import BACKENDS
from offgraph_export.lowering.step_impls import STEP_IMPLS
from offgraph_export.pipeline import FORMATS
from offgraph_export.specs.manifest import StorageDtype


@pytest.mark.parametrize(("option", "defined"), [
    ("step_impl", STEP_IMPLS),
    ("fmt", FORMATS),
    ("executorch_backend", BACKENDS),
    ("max_autotune", AUTOTUNE_CHOICES),
    ("dtype", get_args(StorageDtype)),
])
def test_export_choices_are_the_library_definitions(option, defined):
    (param,) = [p for p in cli.commands["export"].params if p.name == option]
    assert tuple(param.type.choices) == tuple(defined)
