"""One call from a model to a lowered artifact, and each stage on its own.

    export_model      nn.Module -> ExportedProgram (dynamic token width)
    run_passes        validate -> record step width -> build manifest -> strip -> functionalize
                      (each pass alone: offgraph_export.passes.*)
    lower             stripped program -> .pt2 (AOTInductor, specs embedded)
    export_and_lower  all of the above from a ModelBundle
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from offgraph_export.compat import dynamic_dim
from offgraph_export.errors import ExportError
from offgraph_export.lowering.aoti import compile_package
from offgraph_export.lowering.step_impls import StepImpl, default_step_impl, step_impl_name
from offgraph_export.models import ModelBundle
from offgraph_export.passes.bound_table_indices import bound_table_indices
from offgraph_export.passes.build_manifest import build_manifest
from offgraph_export.passes.functionalize import functionalize
from offgraph_export.passes.fuse_projections import fuse_projections
from offgraph_export.passes.graph_utils import describe_inputs, user_input_nodes
from offgraph_export.passes.record_positions import record_positions
from offgraph_export.passes.record_step_width import record_step_width
from offgraph_export.passes.result import PassResult
from offgraph_export.passes.strip_kv_cache import strip_kv_cache
from offgraph_export.passes.validate import validate_kv_sites
from offgraph_export.specs.artifact import ArtifactSpecs, SymbolRange
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import CacheManifest
from offgraph_export.specs.step_width import StepWidthSpec

__all__ = [
    "LoweredProgram",
    "export_model",
    "run_passes",
    "lower",
    "export_and_lower",
]

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


@dataclass
class LoweredProgram:
    """The passes' result: the program over storage inputs plus its two compile specs, and each
    pass's :class:`PassResult` by name, in the order they ran."""

    exported: ExportedProgram
    stripped: ExportedProgram
    step_width: StepWidthSpec
    manifest: CacheManifest
    step_impl: str
    positions_input: int | None = None
    index_bounds: dict[int, int] = field(default_factory=dict)
    options: dict[str, bool | int | str] = field(default_factory=dict)
    pass_results: dict[str, PassResult[Any]] = field(default_factory=dict)

    def artifact_specs(self, device: str, **model_info) -> ArtifactSpecs:
        n_inputs = len(self.exported.graph_signature.user_inputs)
        width_node = user_input_nodes(self.stripped)[self.step_width.input_index]
        width_symbol = str(width_node.meta["val"].shape[self.step_width.dim])
        inputs, symbols = describe_inputs(self.stripped, n_inputs, self.index_bounds)
        # Export raises a dynamic dim's lower bound to 2 (0/1 specialization); the compiled code
        # is shape-generic and a step of one token is valid. A step writes at most max_write.
        hi = symbols[width_symbol].max
        max_write = self.manifest.max_write
        symbols[width_symbol] = SymbolRange(min=1, max=max_write if hi is None else min(hi, max_write))
        return ArtifactSpecs(
            step_width=self.step_width,
            manifest=self.manifest,
            device="cuda" if device.startswith("cuda") else "cpu",
            step_impl=self.step_impl,
            inputs=inputs,
            symbols=symbols,
            torch_version=torch.__version__,
            positions_input=self.positions_input,
            options=self.options,
            **model_info,
        )


def export_model(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    token_dims: Sequence[int | None],
    max_width: int,
) -> ExportedProgram:
    """``torch.export`` with the token dimension of each input dynamic in ``[1, max_width]``."""
    width = dynamic_dim(1, max_width)
    shapes = tuple({d: width} if d is not None else {} for d in token_dims)
    try:
        return torch.export.export(model, tuple(example_inputs), dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # export raises many types; keep the cause chained
        raise ExportError(f"torch.export of {type(model).__name__} failed: {exc}") from exc


def run_passes(
    ep: ExportedProgram,
    example_inputs: Sequence[torch.Tensor],
    cache_config: CacheConfig,
    step_impl: str | StepImpl = "portable",
    fuse: bool = True,
) -> LoweredProgram:
    """validate -> record step width -> record positions -> bound table indices -> fuse
    projections (``fuse``) -> build manifest -> strip -> functionalize.

    ``step_impl``: ``portable``, ``triton``, or a callable with the signature of
    ``portable_update_and_attend`` (recorded in the specs by its ``__name__``)."""
    results: dict[str, PassResult[Any]] = {}
    steps: list[tuple[str, Callable[[ExportedProgram], PassResult[Any]]]] = [
        ("validate_kv_sites", validate_kv_sites),
        ("record_step_width", record_step_width),
        ("record_positions", record_positions),
        ("bound_table_indices", bound_table_indices),
        *([("fuse_projections", lambda p: fuse_projections(p, example_inputs))] if fuse else []),
        ("build_manifest", lambda p: build_manifest(p, cache_config)),
        (
            "strip_kv_cache",
            lambda p: strip_kv_cache(p, results["build_manifest"].produced, example_inputs, step_impl),
        ),
        ("functionalize", functionalize),
    ]
    program = ep
    for name, run in steps:
        results[name] = run(program)
        program = results[name].program
    return LoweredProgram(
        exported=ep,
        stripped=program,
        step_width=results["record_step_width"].produced,
        manifest=results["build_manifest"].produced,
        step_impl=step_impl_name(step_impl),
        positions_input=results["record_positions"].produced,
        index_bounds=results["bound_table_indices"].produced,
        options={"fuse_projections": fuse},
        pass_results=results,
    )


FORMATS = ("pt2", "executorch")


def lower(
    program: LoweredProgram, path: str | Path, device: str, format: str = "pt2",
    executorch_backend: str = "xnnpack", **model_info,
) -> Path:
    """``format``: ``pt2`` (AOTInductor package) or ``executorch`` (``.pte``, cpu, lowered with
    ``executorch_backend``: ``xnnpack`` where it applies, or ``portable``).
    ``model_info``: ``model``, ``model_args``, ``model_dtype`` recorded for check/run."""
    specs = program.artifact_specs(device, **model_info)
    if format == "pt2":
        return compile_package(program.stripped, path, specs)
    if format == "executorch":
        from offgraph_export.lowering.executorch import compile_pte

        return compile_pte(program.stripped, path, specs, backend=executorch_backend)
    raise ExportError(f"unknown format {format!r}; expected one of {FORMATS}")


def export_and_lower(
    bundle: ModelBundle,
    path: str | Path,
    device: str = "cpu",
    step_impl: str | None = None,
    progress: Progress = _noop,
    fuse: bool = True,
    format: str = "pt2",
    executorch_backend: str = "xnnpack",
    **model_info,
) -> tuple[Path, LoweredProgram, dict[str, float]]:
    """Export, run the passes and lower ``bundle`` to ``path``; returns timings in seconds. The
    model is exported for inference: its parameters stop requiring grad."""
    impl = step_impl or default_step_impl(device)
    model = bundle.model.to(device).requires_grad_(False)
    inputs = tuple(x.to(device) for x in bundle.example_inputs)
    timings: dict[str, float] = {}
    progress("exporting")
    t0 = time.perf_counter()
    ep = export_model(model, inputs, bundle.token_dims, bundle.cache_config.max_write)
    timings["export_s"] = time.perf_counter() - t0
    progress(f"running passes (step impl: {impl})")
    t0 = time.perf_counter()
    program = run_passes(ep, inputs, bundle.cache_config, impl, fuse=fuse)
    timings["passes_s"] = time.perf_counter() - t0
    progress(f"compiling ({format}) for {device} (tens of seconds)")
    t0 = time.perf_counter()
    out = lower(program, path, device, format=format, executorch_backend=executorch_backend, **model_info)
    timings["compile_s"] = time.perf_counter() - t0
    return out, program, timings
