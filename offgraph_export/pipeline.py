"""One call from a model to a lowered artifact, and each stage on its own.

    export_model      nn.Module -> ExportedProgram (dynamic token width)
    run_passes        validate -> record step width -> build manifest -> strip -> functionalize
    lower             stripped program -> .pt2 (AOTInductor, specs embedded)
    export_and_lower  all of the above from a ModelBundle
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.lowering.aoti import compile_package
from offgraph_export.models import ModelBundle
from offgraph_export.passes.build_manifest import build_manifest
from offgraph_export.passes.record_step_width import record_step_width, user_input_nodes
from offgraph_export.passes.strip_kv_cache import dynamic_dim, strip_kv_cache
from offgraph_export.passes.validate import validate_kv_sites
from offgraph_export.specs.artifact import ArtifactSpecs, InputSpec, SymbolRange
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import CacheManifest
from offgraph_export.specs.step_width import StepWidthSpec

__all__ = [
    "LoweredProgram",
    "export_model",
    "run_passes",
    "lower",
    "export_and_lower",
    "default_step_impl",
    "functionalize",
]

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


@dataclass
class LoweredProgram:
    """The passes' result: the program over storage inputs plus its two compile specs."""

    exported: ExportedProgram
    stripped: ExportedProgram
    step_width: StepWidthSpec
    manifest: CacheManifest
    step_impl: str

    def artifact_specs(self, device: str, **model_info) -> ArtifactSpecs:
        nodes = user_input_nodes(self.stripped)[: len(self.exported.graph_signature.user_inputs)]
        width_node = nodes[self.step_width.input_index]
        width_symbol = str(width_node.meta["val"].shape[self.step_width.dim])
        inputs, symbols = [], {}
        for node in nodes:
            value = node.meta["val"]
            shape: list[int | str] = []
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    expr = size.node.expr
                    rng = self.stripped.range_constraints[expr]
                    hi = int(rng.upper) if rng.upper.is_finite else None
                    lo = int(rng.lower)
                    if str(expr) == width_symbol:
                        # export raises a dynamic dim's lower bound to 2 (0/1 specialization);
                        # the compiled code is shape-generic and a step of one token is valid.
                        lo = 1
                    symbols[str(expr)] = SymbolRange(min=lo, max=hi)
                    shape.append(str(expr))
                else:
                    shape.append(int(size))
            inputs.append(InputSpec(name=node.name, dtype=str(value.dtype).removeprefix("torch."), shape=shape))
        return ArtifactSpecs(
            step_width=self.step_width.format(),
            manifest=self.manifest,
            device="cuda" if device.startswith("cuda") else "cpu",
            step_impl=self.step_impl,
            inputs=inputs,
            symbols=symbols,
            torch_version=torch.__version__,
            **model_info,
        )


def default_step_impl(device: str) -> str:
    return "triton" if device.startswith("cuda") else "portable"


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
    step_impl: str | Callable[..., torch.Tensor] = "portable",
) -> LoweredProgram:
    """``step_impl``: ``portable``, ``triton``, or a callable with the signature of
    ``portable_update_and_attend`` (recorded in the specs by its ``__name__``)."""
    validate_kv_sites(ep)
    step_width = record_step_width(ep)
    manifest = build_manifest(ep, cache_config)
    validate_kv_sites(ep, manifest)
    stripped = strip_kv_cache(ep, manifest, example_inputs, impl=step_impl)
    stripped = functionalize(stripped)
    name = step_impl if isinstance(step_impl, str) else getattr(step_impl, "__name__", "custom")
    return LoweredProgram(ep, stripped, step_width, manifest, name)


def functionalize(ep: ExportedProgram) -> ExportedProgram:
    """In-place storage writes become declared user-input mutations. Triton ops are decomposed
    into their kernels here (export keeps them as opaque custom ops by default), so that
    AOTInductor compiles the kernels into the package instead of calling the op by name."""
    try:
        return ep.run_decompositions({}, decompose_custom_triton_ops=True)
    except TypeError:  # a torch without the flag
        return ep.run_decompositions({})


def lower(program: LoweredProgram, path: str | Path, device: str, **model_info) -> Path:
    """``model_info``: ``model``, ``model_args``, ``model_dtype`` recorded for check/run."""
    return compile_package(program.stripped, path, program.artifact_specs(device, **model_info))


def export_and_lower(
    bundle: ModelBundle,
    path: str | Path,
    device: str = "cpu",
    step_impl: str | None = None,
    progress: Progress = _noop,
    **model_info,
) -> tuple[Path, LoweredProgram, dict[str, float]]:
    """Export, run the passes and lower ``bundle`` to ``path``; returns timings in seconds."""
    impl = step_impl or default_step_impl(device)
    model = bundle.model.to(device)
    inputs = tuple(x.to(device) for x in bundle.example_inputs)
    timings: dict[str, float] = {}
    progress("exporting")
    t0 = time.perf_counter()
    ep = export_model(model, inputs, bundle.token_dims, bundle.cache_config.max_write)
    timings["export_s"] = time.perf_counter() - t0
    progress(f"running passes (step impl: {impl})")
    t0 = time.perf_counter()
    program = run_passes(ep, inputs, bundle.cache_config, impl)
    timings["passes_s"] = time.perf_counter() - t0
    progress(f"compiling with AOTInductor for {device} (tens of seconds)")
    t0 = time.perf_counter()
    out = lower(program, path, device, **model_info)
    timings["compile_s"] = time.perf_counter() - t0
    return out, program, timings
