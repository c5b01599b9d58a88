"""Every user error of the CLI ends as one line on stderr naming what to fix, with exit 2 and no
traceback; options and output paths are checked before any tracing; --debug shows the traceback."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import EXAMPLE, cli


def _factory(tmp_path: Path, body: str) -> str:
    path = tmp_path / f"factory_{abs(hash(body))}.py"
    path.write_text(body)
    return f"{path}:build"


def _fifo(tmp_path: Path) -> str:
    path = tmp_path / "pipe.pt2"
    os.mkfifo(path)
    return str(path)


def _case(argv, message, before_tracing=True):
    return argv, message, before_tracing


_BUNDLE = """import torch
from offgraph_export.models import ModelBundle
from offgraph_export.specs import CacheConfig
def build():
    return ModelBundle(model=torch.nn.Linear(2, 2), example_inputs=(torch.zeros(1, 4, dtype=torch.int64),),
                       token_dims={dims}, cache_config={config}, make_inputs=lambda t, s: (t,), vocab_size=8)
"""


def _cases(tmp_path: Path, artifact: Path) -> dict[str, tuple]:
    out = str(tmp_path / "out.pt2")
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("x")
    return {
        "factory-raises": _case(["export", _factory(tmp_path, "def build():\n    raise RuntimeError('boom')\n"), "-o", out],
                                "raised RuntimeError: boom"),
        "factory-syntax-error": _case(["export", _factory(tmp_path, "def build(:\n"), "-o", out], "raised SyntaxError"),
        "factory-exits-0": _case(["export", _factory(tmp_path, "import sys\ndef build():\n    sys.exit(0)\n"), "-o", out],
                                 "called exit(0)"),
        "factory-missing-file": _case(["export", str(tmp_path / "nope.py") + ":build", "-o", out], "does not exist"),
        "factory-missing-function": _case(["export", _factory(tmp_path, "x = 1\n"), "-o", out], "has no function 'build'"),
        "unknown-arg-name": _case(["export", EXAMPLE, "-a", "no_such_arg=1", "-o", out], "no_such_arg"),
        "wrongly-typed-arg": _case(["export", EXAMPLE, "-a", "n_layers=many", "-o", out], "model factory"),
        "malformed-arg": _case(["export", EXAMPLE, "-a", "novalue", "-o", out], "NAME=VALUE"),
        "container-arg": _case(["export", EXAMPLE, "-a", "n_layers=[1, 2]", "-o", out], "list values are not taken"),
        "infinite-arg": _case(["export", EXAMPLE, "-a", "n_layers=1e999", "-o", out], "'1e999' is not a finite number"),
        "arg-given-twice": _case(["export", EXAMPLE, "-a", "n_layers=1", "-a", "n_layers=2", "-o", out], "given twice"),
        "dot-stem-output": _case(["export", EXAMPLE, "-o", str(tmp_path / "..pt2")],
                                 "'.' is not a plain folder name"),
        "builtin-factory": _case(["export", "os:system", "-a", f"command='touch {tmp_path / 'ran'}'", "-o", out],
                                 "'os:system' is a builtin_function_or_method, not a Python function"),
        "class-factory": _case(["export", _factory(tmp_path, "class build:\n    pass\n"), "-o", out], "is a type, not a Python function"),
        "output-not-pt2": _case(["export", EXAMPLE, "-o", str(tmp_path / "out.zip")], "must end in .pt2"),
        "output-under-a-file": _case(["export", EXAMPLE, "-o", str(a_file / "x.pt2")], "not a writable directory"),
        "output-is-a-directory": _case(["export", EXAMPLE, "-o", str(tmp_path / "dir.pt2")], "is a directory"),
        # as root os.access says yes to /proc, which takes no new file: the folder is tried for real
        "output-in-proc": _case(["export", EXAMPLE, "-o", "/proc/offgraph_out.pt2"], "'/proc' is not a writable directory"),
        "zero-max-capacity": _case(["export", EXAMPLE, "-o", out, "--max-capacity", "0"], "--max-capacity"),
        "negative-max-write": _case(["export", EXAMPLE, "-o", out, "--max-write", "-4"], "--max-write"),
        "initial-above-max": _case(["export", EXAMPLE, "-o", out, "--max-capacity", "64", "--initial-capacity", "128"],
                                   "initial_capacity=128 exceeds max_capacity=64"),
        "bad-ring": _case(["export", EXAMPLE, "-o", out, "--ring", "1=0"], "LAYER=WINDOW"),
        "triton-on-cpu": _case(["export", EXAMPLE, "-o", out, "--step-impl", "triton"], "runs on cuda only"),
        "cuda-backend-on-cpu": _case(
            ["export", EXAMPLE, "-o", str(tmp_path / "x.pte"), "--format", "executorch", "--executorch-backend", "cuda"],
            "the cuda backend builds for cuda, not cpu",
        ),
        "decode-method-for-pte": _case(
            ["export", EXAMPLE, "-o", str(tmp_path / "x.pte"), "--format", "executorch", "--decode-method"],
            "--decode-method and --max-autotune are AOTInductor options",
        ),
        "bundle-bad-token-dim": _case(["export", _factory(tmp_path, _BUNDLE.format(dims="(7,)", config="CacheConfig()")), "-o", out],
                                      "token_dims[0] = 7 is not a dim of example input 0 (rank 2)"),
        "bundle-config-not-a-config": _case(["export", _factory(tmp_path, _BUNDLE.format(dims="(1,)", config="{}")), "-o", out],
                                            "ModelBundle.cache_config is a dict, not a CacheConfig"),
        "hf-empty-directory": _case(["export", "hf:", "-o", out], "hf: needs a checkpoint directory"),
        "max-write-1": _case(["export", EXAMPLE, "-o", out, "--max-write", "1"], "max_write 1 is too small"),
        "autotune-decode-without-decode-method": _case(["export", EXAMPLE, "-o", out, "--max-autotune", "decode"],
                                                       "tunes the decode method, which this program leaves out"),
        "backend-with-pt2": _case(["export", EXAMPLE, "-o", out, "--executorch-backend", "xnnpack"],
                                  "applies to the executorch format, not pt2"),
        "gemv-on-cpu": _case(["export", EXAMPLE, "-o", out, "--decode-gemv"], "--decode-gemv is a cuda kernel"),
        "rope-on-cpu": _case(["export", EXAMPLE, "-o", out, "--decode-rope"], "--decode-rope folds the rotary"),
        "unknown-command": _case(["frobnicate"], "No such command"),
        "check-without-model": _case(["check", str(artifact)], "--model"),
        "check-zero-steps": _case(["check", str(artifact), "--model", EXAMPLE, "--steps", "0"], "--steps"),
        "check-negative-prefill-chunks": _case(["check", str(artifact), "--model", EXAMPLE, "--prefill-chunks", "-1"],
                                               "--prefill-chunks"),
        "check-graphs-on-cpu-artifact": _case(["check", str(artifact), "--model", EXAMPLE, "--cuda-graphs"], "cuda artifact"),
        "check-missing-artifact": _case(["check", str(tmp_path / "none.pt2"), "--model", EXAMPLE], "does not exist"),
        "run-zero-new-tokens": _case(["run", str(artifact), "--model", EXAMPLE, "--tokens", "1", "--max-new-tokens", "0"],
                                     "--max-new-tokens"),
        "run-prompt-and-tokens": _case(["run", str(artifact), "--model", EXAMPLE, "--tokens", "1", "--prompt", "x"],
                                       "exactly one of"),
        "run-bad-tokens": _case(["run", str(artifact), "--model", EXAMPLE, "--tokens", "1,x"], "comma-separated integers"),
        "run-token-outside-vocabulary": _case(["run", str(artifact), "--model", EXAMPLE, "--tokens", "1,999"],
                                              "outside [0, 256)"),
        "check-prefill-past-capacity": _case(
            ["check", str(artifact), "--model", EXAMPLE, "--prefill-chunks", "300"], "prefill_chunks=300 cannot fit"),
        "run-past-capacity": _case(["run", str(artifact), "--model", EXAMPLE, "--tokens", "1,2", "--max-new-tokens", "300"],
                                   "need 301 tokens of cache; the artifact holds at most 256"),
        "run-token-beyond-int64": _case(["run", str(artifact), "--model", EXAMPLE, "--tokens", "1,99999999999999999999"],
                                        "non-negative int64"),
        "inspect-fifo": _case(["inspect", _fifo(tmp_path)], "is not a regular file"),
        "inspect-directory": _case(["inspect", str(tmp_path)], "is a directory"),
        "hf-missing-directory": _case(["export", f"hf:{tmp_path / 'no_ckpt'}", "-o", out], "no such checkpoint directory"),
        "hf-unknown-option": _case(["export", f"hf:{tmp_path / 'no_ckpt'}", "-a", "colour=red", "-o", out], "colour"),
    } | (
        {}
        if torch.cuda.is_available()
        else {"cuda-without-gpu": _case(["export", EXAMPLE, "-o", out, "--device", "cuda"], "no CUDA device")}
    )


CASE_NAMES = [
    "factory-raises", "factory-syntax-error", "factory-exits-0", "factory-missing-file",
    "factory-missing-function", "unknown-arg-name", "wrongly-typed-arg", "malformed-arg", "output-not-pt2",
    "output-under-a-file", "output-is-a-directory", "zero-max-capacity", "negative-max-write",
    "initial-above-max", "bad-ring", "triton-on-cpu", "cuda-backend-on-cpu", "decode-method-for-pte",
    "gemv-on-cpu", "rope-on-cpu", "unknown-command", "check-without-model",
    "check-zero-steps", "check-negative-prefill-chunks", "check-graphs-on-cpu-artifact",
    "check-missing-artifact", "run-zero-new-tokens", "run-prompt-and-tokens", "run-bad-tokens",
    "run-token-outside-vocabulary", "check-prefill-past-capacity", "run-past-capacity", "run-token-beyond-int64",
    "inspect-fifo", "inspect-directory", "hf-missing-directory",
    "hf-unknown-option", "cuda-without-gpu", "container-arg", "infinite-arg", "arg-given-twice",
    "builtin-factory", "class-factory", "max-write-1", "autotune-decode-without-decode-method",
    "backend-with-pt2", "bundle-bad-token-dim", "bundle-config-not-a-config", "hf-empty-directory",
    "dot-stem-output", "output-in-proc",
]


def test_every_case_is_run(tmp_path, example_artifact):
    """A case added to ``_cases`` but not named here would never run, and a name here without a
    case would be skipped (only ``cuda-without-gpu`` is absent on a machine with a GPU)."""
    cases = set(_cases(tmp_path, example_artifact))
    assert cases <= set(CASE_NAMES)
    assert set(CASE_NAMES) - cases <= {"cuda-without-gpu"}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_user_error_is_one_line_exit_2(name, tmp_path, example_artifact):
    (tmp_path / "dir.pt2").mkdir()
    cases = _cases(tmp_path, example_artifact)
    if name == "cuda-without-gpu" and name not in cases:
        pytest.skip("case for a machine without a CUDA device; this one has one")
    argv, message, _ = cases[name]
    started = time.perf_counter()
    proc = cli(*argv, check=False)
    elapsed = time.perf_counter() - started
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and proc.stderr.rstrip().splitlines()[-1] == lines[0], proc.stderr
    assert message in lines[0], lines[0]
    assert "Failed to initialize NumPy" not in proc.stderr
    assert "tracing" not in proc.stderr and "exporting" not in proc.stderr
    assert not (tmp_path / "out.pt2").exists()
    assert elapsed < 60


def test_debug_shows_the_traceback(tmp_path):
    """--debug adds the traceback and changes no exit code (2: check's "cannot run", not 1, its
    "failed")."""
    factory = _factory(tmp_path, "def build():\n    raise RuntimeError('boom')\n")
    proc = cli("--debug", "export", factory, "-o", str(tmp_path / "o.pt2"), check=False)
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "boom" in proc.stderr
    proc = cli("--debug", "check", str(tmp_path / "none.pt2"), "--model", EXAMPLE, check=False)
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_recorded_factory_resolves_from_another_directory(example_artifact, tmp_path):
    """The artifact records the factory's absolute path, so --recorded-model works from anywhere."""
    import subprocess
    import sys

    from offgraph_export.specs.artifact import read_artifact_specs

    assert Path(read_artifact_specs(example_artifact).model.rpartition(":")[0]).is_absolute()
    proc = subprocess.run(
        [sys.executable, "-m", "offgraph_export", "check", str(example_artifact), "--recorded-model", "--steps", "1"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
