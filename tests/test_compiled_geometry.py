"""Storage geometry rewritten consistently in an archive is refused by the compiled code itself.

The runtime sizes storage from the manifest, which the archive carries twice (the specs entry and
each method's AOTI metadata) and a hostile archive can rewrite in both: every cross-check between
them then agrees. What cannot agree is the compiled library, which writes the geometry it was
compiled for. The runtime runs every method with AOTInductor's own input checks latched on
(``runtime/artifact.py:Artifact._first_run``), so a step over storage of other kv heads, ring
rows or dtype than the library's is refused before any kernel runs, and nothing is committed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from offgraph_export.errors import StepFailed
from offgraph_export.runtime import Artifact
from offgraph_export.runtime.artifact import CHECK_INPUTS_ENV
from offgraph_export.specs.artifact import SPECS_ENTRY
from offgraph_export.specs.manifest import MANIFEST_KEY
from tests.archive_tools import rewrite


def _geometry_edit(change):
    """An ``edit`` for :func:`rewrite` applying ``change(manifest_dict)`` to the manifest in the
    specs entry and in every method's metadata, consistently (what an attacker would do)."""

    def edit(name, data):
        if name.endswith(SPECS_ENTRY):
            specs = json.loads(data)
            change(specs["manifest"])
            return json.dumps(specs).encode()
        if name.endswith("_metadata.json"):
            meta = json.loads(data)
            if MANIFEST_KEY in meta:
                manifest = json.loads(meta[MANIFEST_KEY])
                change(manifest)
                meta[MANIFEST_KEY] = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
            return json.dumps(meta).encode()
        return data

    return edit


def _ring(m):
    return next(l for l in m["layers"] if l["window"] is not None)


CASES = [
    pytest.param(lambda m: _ring(m).update(window=4), "dim value at 2", id="ring-window-16-to-4"),
    pytest.param(lambda m: [l.update(kv_heads=1) for l in m["layers"]], "dim value at 1", id="kv-heads-2-to-1"),
    pytest.param(lambda m: m.update(storage_dtype="bfloat16"), "dtype", id="storage-dtype"),
]


@pytest.mark.parametrize("change, message", CASES)
def test_geometry_rewritten_in_specs_and_metadata_is_refused_by_the_library(example_artifact, example_bundle, tmp_path, change, message):
    original = os.environ.get(CHECK_INPUTS_ENV)
    path = rewrite(example_artifact, tmp_path / "geometry.pt2", _geometry_edit(change))
    artifact = Artifact.load(path)  # every cross-check between the rewritten copies agrees
    session = artifact.new_session()
    before = session.committed_length
    with pytest.raises(StepFailed, match=message):
        session.feed(example_bundle.make_inputs, torch.arange(6).reshape(1, 6))
    assert session.committed_length == before
    assert os.environ.get(CHECK_INPUTS_ENV) == original  # set only around the first call


def test_the_untouched_rewrite_runs_with_the_checks_on(example_artifact, example_bundle, tmp_path):
    """Control: the same rewrite without a change loads and steps (prefill, then one-token steps
    through the general program), its checks latched on."""
    path = rewrite(example_artifact, tmp_path / "same.pt2", _geometry_edit(lambda m: None))
    artifact = Artifact.load(path)
    session = artifact.new_session()
    out = session.feed(example_bundle.make_inputs, torch.arange(6).reshape(1, 6))
    for token in range(3):
        out = session.feed(example_bundle.make_inputs, torch.tensor([[token]]))
    assert session.committed_length == 9 and torch.isfinite(out[0]).all()
    assert artifact._checks_on == {"model"}
