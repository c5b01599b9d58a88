"""The export options' rules, pinned once for the Python API and the CLI alike: every combination
of the option matrix either resolves to the values written out here (an independent table of the
per-device defaults, not the code's own functions) or is refused with the one message that names
its flag; the API refuses before tracing and the CLI exits 2 with the same words."""

from __future__ import annotations

import itertools

import pytest

from offgraph_export.errors import ExportError
from offgraph_export.options import ExportOptions, OptionError
from tests.conftest import EXAMPLE, cli

# (options, expected: a dict of resolved values, or (flag, message) of the refusal)
CASES = {
    "cpu-defaults": (dict(), dict(step_impl="portable", decode_method=False, max_autotune="none", decode_gemv=False,
                                  decode_rope=False, executorch_backend=None)),
    "cuda-defaults": (dict(device="cuda"), dict(step_impl="triton", decode_method=True, max_autotune="decode",
                                                 decode_gemv=True, decode_rope=True)),
    "cuda-n": (dict(device="cuda:1"), dict(step_impl="triton", decode_method=True, decode_gemv=True)),
    "cuda-portable": (dict(device="cuda", step_impl="portable"), dict(decode_gemv=True, decode_rope=False)),
    "cuda-no-decode": (dict(device="cuda", decode_method=False), dict(max_autotune="none", decode_gemv=False, decode_rope=False)),
    "cuda-no-gemv": (dict(device="cuda", decode_gemv=False), dict(decode_gemv=False, decode_rope=True)),
    "cpu-decode-method": (dict(decode_method=True), dict(decode_method=True, max_autotune="none", decode_gemv=False)),
    "pte-cpu": (dict(format="executorch"), dict(executorch_backend="xnnpack", step_impl="portable", decode_method=False)),
    "pte-cuda": (dict(format="executorch", device="cuda"), dict(executorch_backend="cuda", step_impl="portable",
                                                                 decode_method=False, max_autotune="none", decode_gemv=False)),
    "pte-portable": (dict(format="executorch", executorch_backend="portable"), dict(executorch_backend="portable")),
    "triton-on-cpu": (dict(step_impl="triton"), ("--step-impl", "the triton step runs on cuda only")),
    "backend-with-pt2": (dict(executorch_backend="xnnpack"), ("--executorch-backend", "applies to the executorch format, not pt2")),
    "cuda-backend-on-cpu": (dict(format="executorch", executorch_backend="cuda"), ("--executorch-backend", "the cuda backend builds for cuda, not cpu")),
    "xnnpack-on-cuda": (dict(format="executorch", executorch_backend="xnnpack", device="cuda"),
                        ("--executorch-backend", "the xnnpack backend builds for cpu, not cuda")),
    "pte-decode-method": (dict(format="executorch", decode_method=True), ("--format", "are AOTInductor options")),
    "pte-autotune": (dict(format="executorch", max_autotune="all"), ("--format", "are AOTInductor options")),
    "pte-triton": (dict(format="executorch", device="cuda", step_impl="triton"), ("--step-impl", "exports on cpu with the portable step")),
    "gemv-on-cpu": (dict(decode_gemv=True), ("--decode-gemv", "--decode-gemv is a cuda kernel")),
    "gemv-without-decode": (dict(device="cuda", decode_method=False, decode_gemv=True), ("--decode-gemv", "is a cuda kernel")),
    "gemv-for-pte": (dict(format="executorch", device="cuda", decode_gemv=True), ("--decode-gemv", "is a cuda kernel")),
    "rope-on-cpu": (dict(decode_rope=True), ("--decode-rope", "folds the rotary")),
    "rope-portable": (dict(device="cuda", step_impl="portable", decode_rope=True), ("--decode-rope", "the triton step")),
    "autotune-decode-without-decode": (dict(max_autotune="decode"), ("--max-autotune", "tunes the decode method, which this program leaves out")),
    "autotune-all-cpu": (dict(max_autotune="all"), dict(max_autotune="all", decode_method=False)),
    "sessions-for-pte": (dict(format="executorch", decode_sessions=True), ("--decode-sessions", "is a method of a .pt2 batched artifact")),
}

#: the CLI flags of each case's options (the cases the CLI can express on any machine)
_FLAG = {"format": "--format", "device": "--device", "executorch_backend": "--executorch-backend",
         "step_impl": "--step-impl", "max_autotune": "--max-autotune"}


def _argv(options: dict) -> list[str]:
    out = []
    for name, value in options.items():
        if isinstance(value, bool):
            flag = "--" + name.replace("_", "-")
            out.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            out += [_FLAG[name], value]
    return out


@pytest.mark.parametrize("name", CASES)
def test_resolve(name):
    options, expected = CASES[name]
    if isinstance(expected, dict):
        resolved = ExportOptions(**options).resolve()
        for field, value in expected.items():
            assert getattr(resolved, field) == value, (field, resolved)
    else:
        flag, message = expected
        with pytest.raises(OptionError, match=message) as info:
            ExportOptions(**options).resolve()
        assert info.value.flag == flag and isinstance(info.value, ExportError)
        assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("name", [n for n, (_, e) in CASES.items() if isinstance(e, tuple)])
def test_api_refuses_before_tracing(name, tmp_path, monkeypatch):
    """``export_and_lower`` applies the same rules first: the model is never traced."""
    import torch

    from offgraph_export.frontends import load_bundle
    from offgraph_export.pipeline import export_and_lower

    options, (_, message) = CASES[name]

    def never(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(torch.export, "export", never)
    with pytest.raises(OptionError, match=message):
        export_and_lower(load_bundle(EXAMPLE), tmp_path / "never.pt2", **options)
    with pytest.raises(OptionError, match=message):
        export_and_lower(load_bundle(EXAMPLE), tmp_path / "never.pt2", ExportOptions(**options))
    assert list(tmp_path.iterdir()) == []


# a CLI run per flag the rules name, on cpu (each a fresh interpreter: a few seconds apiece)
CLI_CASES = ["triton-on-cpu", "backend-with-pt2", "pte-decode-method", "gemv-on-cpu", "rope-on-cpu",
             "autotune-decode-without-decode", "cuda-backend-on-cpu", "pte-autotune"]


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_refuses_with_the_same_words(name, tmp_path):
    options, (flag, message) = CASES[name]
    assert options.get("device", "cpu") == "cpu"  # on cuda the device check would come first here
    suffix = ".pte" if options.get("format") == "executorch" else ".pt2"
    proc = cli("export", EXAMPLE, "-o", str(tmp_path / f"x{suffix}"), *_argv(options), check=False)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"error: Invalid value for '{flag}'") and message in last, last
    assert "building" not in proc.stderr


def test_every_refusal_names_a_flag_the_cli_has():
    """A refusal names its option by the CLI flag (the API's users read the same words)."""
    from offgraph_export.cli.main import cli as group

    flags = {opt for p in group.commands["export"].params for opt in (*p.opts, *p.secondary_opts)}
    for options, expected in CASES.values():
        if isinstance(expected, tuple):
            assert expected[0] in flags


@pytest.mark.parametrize("options, batched, expected", [
    (dict(device="cuda"), True, True),  # the triton paged step: on
    (dict(device="cuda", step_impl="portable"), True, False),
    (dict(), True, False),  # cpu: the portable step, where the method computes the same thing
    (dict(decode_sessions=True), True, True),  # asked for on cpu: made (the routing's tests use it)
    (dict(device="cuda"), False, False),  # not batched
    (dict(device="cuda"), None, False),  # not known to be batched
    (dict(device="cuda", decode_sessions=False), True, False),
])
def test_the_sessions_method_by_default_where_the_triton_paged_step_runs(options, batched, expected):
    resolved = ExportOptions(**options).resolve(batched=batched)
    assert resolved.decode_sessions is expected
    assert resolved.record().get("decode_sessions", False) is expected


def test_the_sessions_method_needs_a_batched_artifact(tmp_path):
    with pytest.raises(OptionError, match="use it with --max-sessions N") as info:
        ExportOptions(decode_sessions=True).resolve(batched=False)
    assert info.value.flag == "--decode-sessions"
    proc = cli("export", EXAMPLE, "-o", str(tmp_path / "x.pt2"), "--decode-sessions", check=False)
    assert proc.returncode == 2 and "Invalid value for '--decode-sessions'" in proc.stderr and "--max-sessions N" in proc.stderr
    assert "building" not in proc.stderr


def test_unknown_option_and_bad_value_are_option_errors():
    with pytest.raises(OptionError, match="unknown export option 'decode_gemm'"):
        ExportOptions.parse(decode_gemm=True)
    with pytest.raises(OptionError, match="format='zip' is not valid") as info:
        ExportOptions.parse(format="zip")
    assert info.value.flag == "--format"
    with pytest.raises(OptionError, match="unknown device 'tpu'"):
        ExportOptions(device="tpu").resolve()
    with pytest.raises(OptionError, match="max_write 1 is too small"):
        ExportOptions().resolve(max_write=1)


def test_the_record_is_what_the_specs_held():
    """The specs' options: the folds only with a decode method, the autotune mode only for pt2."""
    assert ExportOptions().resolve().record() == {"fuse_projections": True, "max_autotune": "none"}
    assert ExportOptions(device="cuda").resolve().record() == {
        "fuse_projections": True, "decode_gemv": True, "decode_rope": True, "max_autotune": "decode"}
    assert ExportOptions(format="executorch", fuse_projections=False).resolve().record() == {"fuse_projections": False}


def test_the_matrix_never_resolves_to_a_combination_a_rule_refuses():
    """Over the whole matrix, whatever resolves is itself accepted when given explicitly (the
    defaults obey the rules they enforce)."""
    values = dict(format=["pt2", "executorch"], device=["cpu", "cuda"], step_impl=[None, "portable", "triton"],
                  decode_method=[None, True, False], decode_gemv=[None, True, False], decode_rope=[None, True, False])
    resolved_count = 0
    for combo in itertools.product(*values.values()):
        options = dict(zip(values, combo))
        try:
            resolved = ExportOptions(**options).resolve()
        except OptionError:
            continue
        resolved_count += 1
        explicit = resolved.model_dump()
        assert ExportOptions(**explicit).resolve() == resolved, options
    assert resolved_count > 20
