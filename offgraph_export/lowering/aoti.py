"""Lower stripped programs through AOTInductor to one ``.pt2`` package with the specs embedded.

The package holds one compiled program per method (:data:`STEP_METHOD`, and :data:`DECODE_METHOD`
when the specs say so), each under its AOTI model name. The weights are stored outside the
compiled code (``data/weights``, with a per-method ``weights_config.json``), where the packager
stores a tensor both methods use only once; the runtime loads them once and hands the same
tensors to both methods (:mod:`offgraph_export.runtime.weights`).

The specs go in twice: as each method's AOTI metadata (``loader.get_metadata()`` returns them next
to the code they describe, with the method's own program description) and as a JSON entry of the
archive (readable with ``zipfile``, without loading the compiled code). The package is built under
a temporary name and moved into place only when complete, so a failed compile never leaves a
half-written artifact at the requested path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils.serialization import config as serialization_config

from offgraph_export.compat import AOTI_CHECKS_LOWERBOUND, aoti_shim_lacks, fresh_int_array_names, unlifted_module
from offgraph_export.errors import ArtifactError, ExportError
from offgraph_export.lowering.output_files import publish, staging
from offgraph_export.specs.archive import check_package_stem
from offgraph_export.specs.artifact import (
    DECODE_METHOD,
    METHOD_KEY,
    PROGRAM_KEY,
    STEP_METHOD,
    ArtifactSpecs,
    write_artifact_specs,
)
from offgraph_export.specs.constants import CONSTANTS_KEY, check_constants, describe_constants
from offgraph_export.specs.manifest import MANIFEST_KEY
from offgraph_export.specs.step_width import STEP_WIDTH_KEY

__all__ = [
    "compile_package",
    "aoti_metadata",
    "inductor_configs",
    "autotuned",
    "program_constants",
    "COMPILE_STAGES",
]

#: The stages a method's compile time is broken into, each the sum of Inductor's own timers of that
#: name (``torch._dynamo.utils.compilation_time_metrics``; the same names in torch 2.11 and 2.13).
#: ``inductor`` is Inductor's backend from the traced graph on (post-grad passes, then ``lower``,
#: ``codegen`` and ``cpp``); what a method's compile spends before it is reported as ``trace``
#: (AOTInductor tracing the program again and its graph passes). ``lower`` includes ``autotune``
#: (template autotuning runs while the graph is lowered), and ``codegen`` includes
#: ``triton_wait`` (waiting for the kernels compiled in worker processes); ``cpp`` is compiling
#: and linking the C++ wrapper and kernels, within which ``cpp_header`` is building the
#: precompiled header of AOTInductor's C++ runtime (once per machine and compiler flags: a fresh
#: GPU machine pays it in the first method it compiles).
COMPILE_STAGES: dict[str, tuple[str, ...]] = {
    "inductor": ("compile_fx_inner",),
    "lower": ("GraphLowering.run",),
    "codegen": ("GraphLowering.codegen",),
    "cpp": ("AotCodeCompiler.compile",),
    "cpp_header": ("aoti_precompile_header",),
    "triton_wait": ("async_compile.wait",),
}
_AUTOTUNE_TIMER_SUFFIX = "_template_autotuning"


def _inductor_stage_totals() -> dict[str, float]:
    """Inductor's cumulative seconds per :data:`COMPILE_STAGES` stage (and ``autotune``) in this
    process so far; the difference of two readings is what happened between them."""
    from torch._dynamo import utils as dynamo_utils

    metrics: dict[str, list[float]] = getattr(dynamo_utils, "compilation_time_metrics", {})
    totals = {stage: float(sum(sum(metrics.get(name, ())) for name in names)) for stage, names in COMPILE_STAGES.items()}
    totals["autotune"] = float(sum(sum(v) for k, v in metrics.items() if k.endswith(_AUTOTUNE_TIMER_SUFFIX)))
    return totals



def program_constants(ep: ExportedProgram) -> dict[str, Any]:
    """The tensors AOTInductor stores as the program's constants, by the names it gives them."""
    return {k: v for k, v in {**ep.state_dict, **ep.constants}.items() if hasattr(v, "dtype")}


def lowering_scalars(ep: ExportedProgram) -> list[int]:
    """The int64 scalars AOTInductor adds as constants while lowering ``ep``: the group size of its
    ``_weight_int4pack_mm_for_cpu`` calls (``passes/cpu_int4_linear.py``). At most one value: the
    loader accepts such a scalar by value, not by name (the compiler names it), so with two group
    sizes a hostile archive could swap them and make a kernel read past its scales."""
    values = sorted({int(n.args[2]) for n in ep.graph.nodes if n.target is torch.ops.aten._weight_int4pack_mm_for_cpu.default})
    if len(values) > 1:
        raise ExportError(f"int4 CPU kernels with group sizes {values} in one method; expected one group size")
    return values


def aoti_metadata(specs: ArtifactSpecs, method: str = STEP_METHOD, constants: str = "{}") -> dict[str, str]:
    """``constants``: the method's :func:`~offgraph_export.specs.constants.describe_constants`."""
    return {
        STEP_WIDTH_KEY: specs.step_width.format(),
        MANIFEST_KEY: specs.manifest.to_json(),
        PROGRAM_KEY: specs.program_description(method),
        METHOD_KEY: method,
        CONSTANTS_KEY: constants,
    }


def autotuned(specs: ArtifactSpecs, method: str) -> bool:
    """Whether ``method`` is compiled with max-autotune, per ``specs.options["max_autotune"]``."""
    choice = specs.options.get("max_autotune", "none")
    return choice == "all" or (choice == "decode" and method == DECODE_METHOD)


def inductor_configs(specs: ArtifactSpecs, method: str, constants: str = "{}") -> dict[str, Any]:
    """The inductor options ``method`` is compiled with: metadata, weights kept out of the
    compiled library (so methods share them), and max-autotune where the specs ask for it."""
    configs: dict[str, Any] = {
        "aot_inductor.package": True,
        "aot_inductor.metadata": aoti_metadata(specs, method, constants),
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.package_constants_on_disk_format": "pickle_weights",
    }
    if autotuned(specs, method):
        configs["max_autotune"] = True
    if specs.device == "cuda":
        # A cuda package's host code has no vectorized CPU kernel, yet AOTInductor first probes which
        # CPU vector ISAs work: on torch 2.11 each probe compiles a library and starts a Python that
        # imports torch to load it, and the probes raced in its threads: 11 of them, about 60 s of a
        # fresh 1B cuda build's 83 s C++ stage on the H100 machine (benchmarks/h100-2026-12-08-build).
        configs["cpp.vec_isa_ok"] = False
    if AOTI_CHECKS_LOWERBOUND:
        # The runtime runs every library with its input checks on (runtime/artifact.py); a dynamic
        # dim's compiled lower bound is 2 whatever export recorded (docs/design.md, one-token
        # steps), and the general method serves one-token steps where there is no decode method.
        configs["aot_inductor.check_lowerbound"] = False
    return configs


def _check_stored_weights(files: list[Any], constants: str, method: str) -> None:
    """The weights AOTInductor is about to store for ``method`` are the constants described in its
    metadata (names, dtypes, shapes): otherwise the package could never load."""
    # AOTInductor lists the weights it will store as a dict (its ``Weights``) of name -> (tensor, properties).
    stored = next((f for f in files if isinstance(f, dict)), None)
    if stored is None:
        raise ExportError(f"AOTInductor kept method {method!r}'s weights inside its library; expected them on disk")
    try:
        check_constants({name: tensor for name, (tensor, _) in stored.items()}, constants, method, "the compiled package")
    except ArtifactError as exc:
        raise ExportError(str(exc)) from exc


#: aten ops a decoder may call whose AOTInductor C shim some torch versions lack (``aten.X``)
_SHIM_CHECKED = ("_grouped_mm",)


def _refuse_unshimmed_ops(programs: Mapping[str, ExportedProgram], device: str) -> None:
    """Refuse, before minutes of compiling, a program calling an op this torch's AOTInductor cannot
    emit for ``device`` (the C++ wrapper would not compile: ``aoti_torch_cuda__grouped_mm`` was not
    declared)."""
    called = {n.target._opname for ep in programs.values() for n in ep.graph.nodes  # type: ignore[union-attr]
              if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
              and n.target.namespace == "aten" and n.target._opname in _SHIM_CHECKED}
    lacking = aoti_shim_lacks(device, sorted(called))
    if lacking:
        raise ExportError(
            f"the model calls aten.{lacking[0]} (a mixture-of-experts layer), which AOTInductor of torch "
            f"{torch.__version__} cannot compile for {device} (its C shim lacks it; torch 2.13 has it): use a "
            "newer torch, or for a transformers model set model.set_experts_implementation('batched_mm') "
            "(the Python API) before exporting"
        )


def compile_package(
    programs: Mapping[str, ExportedProgram],
    path: str | os.PathLike,
    specs: ArtifactSpecs,
    progress: Callable[[str], None] = lambda _: None,
    method_seconds: dict[str, float] | None = None,
    stage_seconds: dict[str, float] | None = None,
) -> Path:
    """AOT-compile each of ``programs`` (method name -> program, exactly ``specs.methods``) for
    ``specs.device`` into one package at ``path`` (a ``.pt2``). ``method_seconds``, when given, gets
    each method's compile time by name as it finishes (a package's compile time is nearly all
    these; what is left is packaging), and ``progress`` is told it. ``stage_seconds``, when given,
    gets ``"<method>_<stage>"`` for each of :data:`COMPILE_STAGES` (and ``autotune``, ``trace``) and
    ``"package"``, the time writing the archive took."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    target = Path(path)
    if target.suffix != ".pt2":
        raise ExportError(f"artifact path {str(target)!r} must end in .pt2")
    try:  # the archive's root folder is the file's stem: refuse a stem its own loader would refuse
        check_package_stem(target.stem, str(target))
    except ArtifactError as exc:
        raise ExportError(
            f"artifact file name {target.name!r} cannot name the package's folder: {target.stem!r} is not a "
            "plain folder name; pick another name"
        ) from exc
    if sorted(programs) != sorted(specs.methods):
        raise ExportError(f"got programs for methods {sorted(programs)}, the specs name {specs.methods}")
    _refuse_unshimmed_ops(programs, specs.device)
    # The archive's root folder is named after the file stem, so keep the stem.
    with staging(target) as tmp_dir:
        tmp = tmp_dir / target.name
        files: dict[str, list[Any]] = {}
        for method in specs.methods:
            ep = programs[method]
            tuned = " with max-autotune" if autotuned(specs, method) else ""
            progress(f"compiling method {method!r} for {specs.device}{tuned}")
            args, kwargs = ep.example_inputs
            constants = describe_constants(program_constants(ep), lowering_scalars(ep))
            started, before = time.perf_counter(), _inductor_stage_totals()
            try:
                with fresh_int_array_names():
                    files[method] = aot_compile(
                        unlifted_module(ep), args, kwargs, options=inductor_configs(specs, method, constants)
                    )
            except Exception as exc:  # inductor raises many types; keep the cause chained
                raise ExportError(f"AOTInductor compile of method {method!r} for {specs.device} failed: {exc}") from exc
            seconds = time.perf_counter() - started
            stages = {k: v - before[k] for k, v in _inductor_stage_totals().items()}
            stages["trace"] = max(seconds - stages["inductor"], 0.0)
            if method_seconds is not None:
                method_seconds[method] = seconds
            if stage_seconds is not None:
                stage_seconds.update({f"{method}_{stage}": v for stage, v in stages.items()})
            progress(
                f"compiled method {method!r} in {seconds:.1f}s (tracing {stages['trace']:.1f}s; lowering "
                f"{stages['lower']:.1f}s, of which autotuning "
                f"{stages['autotune']:.1f}s; code generation {stages['codegen']:.1f}s, of which waiting for kernels "
                f"{stages['triton_wait']:.1f}s; C++ {stages['cpp']:.1f}s, of which the precompiled header "
                f"{stages['cpp_header']:.1f}s)"
            )
            _check_stored_weights(files[method], constants, method)
        started = time.perf_counter()
        try:
            # Each weight file is a torch.save zip inside the package. Its own records go without a
            # CRC-32: the package's member that holds the file has one, which the loader verifies
            # as it reads (runtime/weights.py), and computing the inner one too took most of the
            # packaging time (dev CPU: torch.save at 0.27 GB/s with it, 1.57 without).
            # torch.load reads records that have none.
            with serialization_config.patch({"save.compute_crc32": False}):
                package_aoti(str(tmp), files)
        except Exception as exc:
            raise ExportError(f"packaging the compiled methods failed: {exc}") from exc
        packaged = time.perf_counter() - started
        if stage_seconds is not None:
            stage_seconds["package"] = packaged
        progress(f"packaged the weights and methods in {packaged:.1f}s")
        write_artifact_specs(tmp, specs)
        publish([(tmp, target)], tmp_dir)
    return target
