"""What the Triton kernel tests share: whether triton, CUDA and the interpreter are here, the
skip markers, and the child process that runs a module's ``test_interp_*`` cases under
``TRITON_INTERPRET=1`` (the interpreter must be chosen before triton is imported, so those cases
cannot run in the parent)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_CUDA = torch.cuda.is_available()
REPO_ROOT = Path(__file__).resolve().parents[1]

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
interpreter_only = pytest.mark.skipif(
    not (HAVE_TRITON and INTERPRETING),
    reason="interpreter case: runs in the TRITON_INTERPRET=1 child of its module's interpreter suite",
)
needs_cuda = pytest.mark.skipif(
    not (HAVE_CUDA and HAVE_TRITON and not INTERPRETING),
    reason="needs an NVIDIA GPU and triton (and TRITON_INTERPRET unset)",
)


def run_interpreter_cases(test_file: str) -> None:
    """Run ``test_file``'s ``test_interp_*`` cases in a child process with ``TRITON_INTERPRET=1``;
    fail unless they all ran and passed."""
    if INTERPRETING:
        pytest.skip("this process is the interpreter child; its cases run directly")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-k", "test_interp_", "-q",
         "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, report
