"""``specs/constants.py``: the weights a method receives must be the constants it was compiled for,
strides included (a zero-stride view of a small file where the program reads a dense block would be
read past its end), and a package of an earlier version, which recorded no strides, takes dense
views only."""

from __future__ import annotations

import json

import pytest
import torch

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.constants import check_constants, describe_constants


def test_strides_are_part_of_what_a_method_was_compiled_for():
    expanded = torch.randn(1, 8).expand(4, 8)  # a legitimately strided constant (stride 0)
    dense = torch.randn(4, 8)
    description = describe_constants({"b": expanded, "w": dense})
    assert json.loads(description) == {"b": ["float32", [4, 8], [0, 1]], "w": ["float32", [4, 8], [8, 1]]}
    check_constants({"b": expanded, "w": dense.clone()}, description, "model", "p.pt2")
    with pytest.raises(ArtifactError, match=r"weight 'w' is float32 \[4, 8\] strides \[0, 1\] but the program was compiled for"):
        check_constants({"w": torch.randn(1, 8).expand(4, 8)}, description, "model", "p.pt2")
    with pytest.raises(ArtifactError, match=r"weight 'b' is float32 \[4, 8\] strides \[8, 1\]"):
        check_constants({"b": dense}, description, "model", "p.pt2")


def test_a_description_without_strides_takes_dense_views_only():
    old = json.dumps({"w": ["float32", [4, 8]]})
    check_constants({"w": torch.randn(8, 4).t()}, old, "model", "p.pt2")  # dense, another order
    with pytest.raises(ArtifactError, match=r"strides \[0, 1\], which a package without recorded strides cannot vouch for"):
        check_constants({"w": torch.randn(1, 8).expand(4, 8)}, old, "model", "p.pt2")
    with pytest.raises(ArtifactError, match="malformed"):
        check_constants({"w": torch.randn(4, 8)}, json.dumps({"w": "float32"}), "model", "p.pt2")
