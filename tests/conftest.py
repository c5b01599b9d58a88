"""Shared fixtures. AOTInductor compiles cost 10-30 s each on a CI machine, so compiled
artifacts are built once per test session and shared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "tiny_llama.py") + ":build"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def first_step_logits(program, make_inputs, tokens):
    """The outputs' first tensor of ``tokens`` fed as one step through a fresh session of
    ``program`` (closed after)."""
    from offgraph_export.runtime.session import Session

    session = Session(program)
    try:
        return session.feed(make_inputs, tokens)[0]
    finally:
        session.close()


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the ``offgraph-export`` CLI in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-m", "offgraph_export", *args], capture_output=True, text=True, cwd=ROOT
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"offgraph-export {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}\n{proc.stdout}")
    return proc


@pytest.fixture(scope="session")
def example_factory() -> str:
    return EXAMPLE


@pytest.fixture(scope="session")
def example_export(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The bundled example (layer 0 flat, layer 1 ring of 16) exported through the CLI for cpu with
    ``--json``: the artifact's path and what ``export`` printed (its summary, its progress lines)."""
    out = tmp_path_factory.mktemp("artifacts") / "tiny.pt2"
    return out, cli("export", EXAMPLE, "-o", str(out), "--json")


@pytest.fixture(scope="session")
def example_artifact(example_export) -> Path:
    """The bundled example's artifact (:func:`example_export`)."""
    return example_export[0]


@pytest.fixture(scope="session")
def loaded_example(example_artifact):
    from offgraph_export.runtime import Artifact

    return Artifact.load(example_artifact)


@pytest.fixture
def example_bundle():
    from offgraph_export.frontends import load_bundle

    return load_bundle(EXAMPLE)


@pytest.fixture(scope="session")
def guarded(tmp_path_factory):
    """``tiny_models.Guarded`` compiled for cpu: ``(artifact, model, cache config)``. Its steps
    take ``(x [1,T,32], position [T], fail [1])`` and fail inside the program when ``fail`` != 0."""
    from offgraph_export.pipeline import export_model, lower, run_passes
    from offgraph_export.runtime import Artifact
    from offgraph_export.specs import CacheConfig
    from tests import tiny_models

    model = tiny_models.Guarded().eval()
    config = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16, ring_windows={1: 4})
    inputs = (torch.randn(1, 5, 32), torch.arange(5), torch.zeros(1, dtype=torch.int64))
    ep = export_model(model, inputs, (1, 0, None), config.max_write)
    path = lower(run_passes(ep, inputs, config), tmp_path_factory.mktemp("guarded") / "guarded.pt2", "cpu")
    return Artifact.load(path), model, config
