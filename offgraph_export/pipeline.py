"""One call from a model to a lowered artifact, and each stage on its own.

    export_model      nn.Module -> ExportedProgram (dynamic token width)
    run_passes        validate -> record step width -> ... -> strip -> functionalize
                      [-> specialize width: the decode method] (each pass alone:
                      offgraph_export.passes.*)
    lower             stripped program(s) -> .pt2 (AOTInductor, specs embedded) or .pte
    export_and_lower  all of the above from a ModelBundle
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from offgraph_export.compat import aoti_shim_declares, aoti_shim_lacks, dynamic_dim
from offgraph_export.errors import ExportError
from offgraph_export.frontends.torchao_weights import (
    convert_torchao_weights, export_scheme, float_stand_ins, torchao_parameters,
)
from offgraph_export.lowering.aoti import compile_package
from offgraph_export.kernels.step_impls import StepImpl, step_impl_name
from offgraph_export.models import ModelBundle
from offgraph_export.options import ExportOptions, OptionError, device_kind, lowering_record, pass_record
from offgraph_export.passes.bound_table_indices import bound_table_indices
from offgraph_export.passes.build_manifest import build_manifest
from offgraph_export.passes.cpu_int4_linear import cpu_int4_linear
from offgraph_export.passes.cpu_int8_linear import cpu_int8_linear
from offgraph_export.passes.decode_gemv import decode_gemv as decode_gemv_pass
from offgraph_export.passes.decode_rope import decode_rope as decode_rope_pass
from offgraph_export.passes.decode_sessions import decode_sessions as decode_sessions_pass
from offgraph_export.passes.functionalize import functionalize
from offgraph_export.passes.fuse_projections import fuse_projections, fused_weight_name
from offgraph_export.passes.graph_utils import describe_inputs, output_width_dims, user_input_nodes
from offgraph_export.passes.record_positions import record_positions
from offgraph_export.passes.quantize_weights import quantize_weights
from offgraph_export.passes.record_step_width import record_step_width
from offgraph_export.passes.result import PassResult
from offgraph_export.passes.split_to_slices import split_to_slices
from offgraph_export.passes.specialize_width import specialize_width
from offgraph_export.passes.strip_kv_cache import strip_kv_cache
from offgraph_export.passes.validate import validate_kv_sites
from offgraph_export.reference.weight_quant import QuantizedTensors
from offgraph_export.specs.artifact import DECODE_METHOD, SESSIONS_METHOD, STEP_METHOD, ArtifactSpecs, SymbolRange
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import CacheManifest
from offgraph_export.specs.quantization import GROUPED_SCHEMES, QuantizationSpec
from offgraph_export.specs.step_width import StepWidthSpec

__all__ = [
    "StrippedProgram",
    "export_model",
    "run_passes",
    "lower",
    "export_and_lower",
    "takes_cpu_int8_kernel",
    "takes_cpu_int4_kernel",
]

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


@dataclass
class StrippedProgram:
    """The passes' result, not yet lowered: the program over storage inputs plus its two compile
    specs, and each pass's :class:`PassResult` by name, in the order they ran. ``decode``: the same program with
    the width fixed at 1 (the decode method), when asked for."""

    exported: ExportedProgram
    stripped: ExportedProgram
    step_width: StepWidthSpec
    manifest: CacheManifest
    step_impl: str
    positions_input: int | None = None
    index_bounds: dict[int, int] = field(default_factory=dict)
    options: dict[str, bool | int | str] = field(default_factory=dict)
    pass_results: dict[str, PassResult[Any]] = field(default_factory=dict)
    decode: ExportedProgram | None = None
    #: a batched program's sessions method (decode steps of several sessions), when asked for
    sessions: ExportedProgram | None = None
    #: the quantized weights (design section 11), when asked for and the program has linears
    quantization: QuantizationSpec | None = None
    #: each pass's seconds, by the name it has in ``pass_results``
    pass_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def programs(self) -> dict[str, ExportedProgram]:
        """The program of each method, by the name the package stores it under."""
        methods = {STEP_METHOD: self.stripped}
        if self.decode is not None:
            methods[DECODE_METHOD] = self.decode
        if self.sessions is not None:
            methods[SESSIONS_METHOD] = self.sessions
        return methods

    def artifact_specs(self, device: str, options: dict[str, bool | int | str] | None = None, **model_info) -> ArtifactSpecs:
        """The specs of this program lowered for ``device``; ``options``: lowering options
        recorded beside the passes' own."""
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
            options={**self.options, **(options or {})},
            decode_method=self.decode is not None,
            sessions_method=self.sessions is not None,
            quantization=self.quantization,
            output_width_dims=output_width_dims(self.stripped, width_symbol),
            **model_info,
        )


def export_model(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    token_dims: Sequence[int | None],
    max_width: int,
) -> ExportedProgram:
    """``torch.export`` with the token dimension of each input dynamic in ``[1, max_width]``. A
    model holding torchao-quantized weights is refused here: :func:`export_and_lower` (and the
    CLI) takes them into the stored form (design section 11)."""
    held = torchao_parameters(model)
    if held:
        name, value = next(iter(held.items()))
        raise ExportError(
            f"{name} is a torchao {type(value).__name__}: export_model traces float weights; export a model quantized "
            "with torchao through export_and_lower or the CLI, which store its weights as they are (design section 11)"
        )
    width = dynamic_dim(1, max_width)
    shapes = tuple({d: width} if d is not None else {} for d in token_dims)
    try:
        return torch.export.export(model, tuple(example_inputs), dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # export raises many types; keep the cause chained
        data_dependent = _data_dependent_branch(exc)
        if data_dependent:
            raise ExportError(f"torch.export of {type(model).__name__} failed: {data_dependent}") from exc
        raise ExportError(f"torch.export of {type(model).__name__} failed: {exc}") from exc


_RAISING_CALL = re.compile(r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \S+\s*\n\s*(.+)')


def _data_dependent_branch(exc: BaseException) -> str | None:
    """One line for a model whose Python code branches or loops on a tensor's values (a
    mixture-of-experts layer that loops over the experts its tokens chose, DBRX's): export traces
    one graph for every input, so it cannot record that; None for any other failure."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    text = str(exc)
    if not isinstance(exc, GuardOnDataDependentSymNode) and "Could not guard on data-dependent expression" not in text:
        return None
    expression = text.split("Could not guard on data-dependent expression", 1)[-1].split("(unhinted", 1)[0].strip()
    where = _RAISING_CALL.search(text)
    place = (f" at {Path(where.group(1)).name}:{where.group(2)} (`{where.group(3).strip()}`)" if where else "")
    return (
        f"the model's code{place} branches on the values of a tensor ({expression or 'a data-dependent size'}), "
        "as a mixture-of-experts layer that loops over the experts its tokens chose does; one exported graph "
        "serves every input, so such code cannot be exported (not supported: a model whose experts run "
        "as one batched computation, as Mixtral's and Qwen-MoE's do, exports)"
    )


def run_passes(
    ep: ExportedProgram,
    example_inputs: Sequence[torch.Tensor],
    cache_config: CacheConfig,
    step_impl: str | StepImpl = "portable",
    fuse: bool = True,
    decode_method: bool = False,
    decode_gemv: bool = False,
    decode_rope: bool = False,
    decode_sessions: bool = False,
    quantize: str = "none",
    group_size: int | None = None,
    progress: Progress = _noop,
    stored: Mapping[str, QuantizedTensors] | None = None,
    quantize_others: bool = True,
    quantize_lm_head: str | None = None,
    lowering_traces: bool = False,
    cpu_int8_kernel: bool = False,
    cpu_int4_kernel: bool = False,
) -> StrippedProgram:
    """validate -> record step width -> record positions -> bound table indices -> fuse
    projections (``fuse``) -> quantize weights (``quantize``: ``int8`` or ``int4`` with
    ``group_size``) -> build manifest -> strip -> functionalize [and, from the stripped
    program, specialize width -> GEMV projections (``decode_gemv``) -> rotary embedding into the
    attention kernel (``decode_rope``) -> functionalize: the decode
    method (``decode_method``)] [and, for a batched program, re-trace -> one row per session ->
    functionalize: the sessions method (``decode_sessions``)].

    ``stored``: weights quantized already (a torchao model's, by model parameter name), stored as
    they are by the quantize pass; ``quantize_others``: whether it quantizes the other linears too;
    ``quantize_lm_head``: the lm_head's own scheme (``int8``, ``int4``, ``none``), None for ``quantize``'s.
    ``lowering_traces``: the programs go to AOTInductor, whose own trace functionalizes them and
    decomposes the triton step, so ``functionalize`` decomposes only what it would call by name
    (``passes/functionalize.py``); False (an ExecuTorch lowering, or a caller's own use of the
    programs) leaves every program functional and decomposed. ``cpu_int8_kernel``: the programs go
    to AOTInductor for cpu, whose int8 linears in bf16/fp16 then take torch's int8 CPU kernel
    (``passes/cpu_int8_linear.py``; the general and decode methods, before ``functionalize``);
    ``cpu_int4_kernel``: likewise, int4 linears take torch's int4 CPU kernel
    (``passes/cpu_int4_linear.py``, its packed weights made once for both methods).

    ``step_impl``: ``portable``, ``triton``, or a callable with the signature of
    ``portable_update_and_attend`` (recorded in the specs by its ``__name__``). Each pass's time
    is kept in ``pass_seconds`` and told to ``progress`` as it ends (a large model's passes take
    minutes: this says which)."""
    results: dict[str, PassResult[Any]] = {}
    seconds: dict[str, float] = {}

    def timed(name: str, run: Callable[[], PassResult[Any]]) -> PassResult[Any]:
        t0 = time.perf_counter()
        results[name] = run()
        seconds[name] = time.perf_counter() - t0
        progress(f"  pass {name}: {seconds[name]:.1f}s")
        return results[name]

    def functional(p: ExportedProgram) -> PassResult[None]:
        return functionalize(p, lowering_traces)

    int4_packed: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # one packing, both methods
    cpu_kernels = [("cpu_int8_linear", cpu_int8_linear)] if cpu_int8_kernel else []
    cpu_kernels += [("cpu_int4_linear", lambda p: cpu_int4_linear(p, int4_packed))] if cpu_int4_kernel else []

    steps: list[tuple[str, Callable[[ExportedProgram], PassResult[Any]]]] = [
        ("validate_kv_sites", validate_kv_sites),
        ("record_step_width", record_step_width),
        ("record_positions", record_positions),
        ("bound_table_indices", bound_table_indices),
        *([("fuse_projections", lambda p: fuse_projections(p, example_inputs))] if fuse else []),
        *([("quantize_weights", lambda p: quantize_weights(
            p, example_inputs, quantize, group_size, _fused_sources(results.get("fuse_projections")),
            stored, quantize_others, quantize_lm_head))]
          if quantize != "none" else []),
        ("build_manifest", lambda p: build_manifest(p, cache_config)),
        (
            "strip_kv_cache",
            lambda p: strip_kv_cache(p, results["build_manifest"].produced, example_inputs, step_impl),
        ),
        *cpu_kernels,
        ("functionalize", functional),
    ]
    program = ep
    for name, run in steps:
        program = timed(name, lambda: run(program)).program
    decode = None
    if decode_method:
        # From the program before functionalize: that pass decomposes the triton step into the
        # kernels chosen for a symbolic width, and the one-token kernels are chosen only where
        # the width is the constant 1, so the decode method is traced and decomposed on its own.
        stripped = results["strip_kv_cache"].program
        decode_program = timed("specialize_width", lambda: specialize_width(stripped, results["record_step_width"].produced)).program
        if decode_gemv:
            decode_program = timed("decode_gemv", lambda: decode_gemv_pass(decode_program)).program
        if decode_rope:
            decode_program = timed("decode_rope", lambda: decode_rope_pass(decode_program)).program
        if cpu_int8_kernel:
            decode_program = timed("cpu_int8_linear_decode", lambda: cpu_int8_linear(decode_program)).program
        if cpu_int4_kernel:
            decode_program = timed("cpu_int4_linear_decode", lambda: cpu_int4_linear(decode_program, int4_packed)).program
        decode = timed("functionalize_decode", lambda: functional(decode_program)).program
    sessions = None
    if decode_sessions:
        if results["build_manifest"].produced.paging is None:
            raise ExportError("the sessions method is a batched artifact's (decode steps of several sessions): export with max_sessions")
        stripped = results["strip_kv_cache"].program
        retraced = timed("retrace_sessions", lambda: specialize_width(stripped, results["record_step_width"].produced, width=None))
        rewritten = timed("decode_sessions", lambda: decode_sessions_pass(retraced.program))
        sessions = timed("functionalize_sessions", lambda: functional(rewritten.program)).program
    return StrippedProgram(
        exported=ep,
        stripped=program,
        step_width=results["record_step_width"].produced,
        manifest=results["build_manifest"].produced,
        step_impl=step_impl_name(step_impl),
        positions_input=results["record_positions"].produced,
        index_bounds=results["bound_table_indices"].produced,
        options=pass_record(fuse, decode_method, decode_gemv, decode_rope, decode_sessions, quantize, group_size, quantize_lm_head),
        pass_results=results,
        pass_seconds=seconds,
        decode=decode,
        sessions=sessions,
        quantization=results["quantize_weights"].produced if "quantize_weights" in results else None,
    )


def takes_cpu_int8_kernel(fmt: str, device: str, quantize: str, quantize_lm_head: str | None) -> bool:
    """Whether an export's int8 linears in bf16/fp16 take torch's int8 CPU kernel: a cpu ``.pt2``
    storing some weight as int8, with a torch whose AOTInductor CPU shim declares the kernel."""
    if fmt != "pt2" or device_kind(device) != "cpu" or "int8" not in (quantize, quantize_lm_head):
        return False
    return not aoti_shim_lacks("cpu", ["_weight_int8pack_mm"])


def takes_cpu_int4_kernel(fmt: str, device: str, quantize: str, quantize_lm_head: str | None) -> bool:
    """Whether an export's int4 linears in bf16/fp16 take torch's int4 CPU kernel: a cpu ``.pt2``
    storing some weight as int4, with a torch whose AOTInductor CPU shim declares the kernel."""
    if fmt != "pt2" or device_kind(device) != "cpu" or "int4" not in (quantize, quantize_lm_head):
        return False
    return aoti_shim_declares("aoti_torch_cpu__weight_int4pack_mm_cpu_tensor")


def _fused_sources(fused: PassResult[list[list[str]]] | None) -> dict[str, list[str]]:
    """Each fused weight's name and the model parameters it was made of, in row order."""
    return {fused_weight_name(i): names for i, names in enumerate(fused.produced)} if fused else {}


def lower(
    program: StrippedProgram, path: str | Path, device: str = "cpu", format: str = "pt2",
    executorch_backend: str | None = None, max_autotune: str = "none",
    progress: Progress = _noop, method_seconds: dict[str, float] | None = None,
    stage_seconds: dict[str, float] | None = None, **model_info,
) -> Path:
    """``format``: ``pt2`` (AOTInductor package with a method per program) or ``executorch``
    (``.pte`` lowered with ``executorch_backend``, by default ``xnnpack`` on cpu and ``cuda`` on
    cuda, the program exported on cpu). ``max_autotune``: one of ``AUTOTUNE_CHOICES`` (pt2),
    recorded in the specs. ``method_seconds``: filled with each pt2 method's compile time by name
    (:func:`~offgraph_export.lowering.aoti.compile_package`), ``stage_seconds`` with its stages
    (``"<method>_<stage>"``, ``"package"``). The options are checked by
    :meth:`ExportOptions.resolve` against the program (its decode method, its ``max_write``). ``model_info``: ``model``, ``model_args``,
    ``model_dtype`` recorded for check/run. For the executorch ``cuda`` backend
    ``program.stripped`` is first rewritten in place by ``split_to_slices`` (same values; a second
    lowering finds nothing left to rewrite)."""
    options = ExportOptions.parse(
        format=format, device=device, executorch_backend=None if format == "pt2" else executorch_backend,
        decode_method=program.decode is not None, max_autotune=max_autotune,
        decode_sessions=True if program.sessions is not None else None,
    ).resolve(program.manifest.max_write, batched=program.manifest.paging is not None)
    if format == "pt2":
        specs = program.artifact_specs(device, options=lowering_record(format, options.max_autotune), **model_info)
        return compile_package(program.programs, path, specs, progress, method_seconds, stage_seconds)
    from offgraph_export.lowering.executorch import compile_pte

    specs = program.artifact_specs(device, **model_info)
    if options.executorch_backend == "cuda":
        # ExecuTorch's CUDA backend compiles slices but has no split_copy kernel
        program.pass_results["split_to_slices"] = split_to_slices(program.stripped)
    return compile_pte(program.stripped, path, specs, backend=options.executorch_backend)


def _fit_width(
    inputs: tuple[torch.Tensor, ...], token_dims: tuple[int | None, ...], max_write: int, device: str
) -> tuple[torch.Tensor, ...]:
    """The example inputs on ``device``, cut along their token dims to at most ``max_write``
    tokens (a model's example may be wider than the width the export allows)."""
    return tuple(
        (x.narrow(d, 0, max_write) if d is not None and x.shape[d] > max_write else x).to(device)
        for x, d in zip(inputs, token_dims)
    )


def export_and_lower(
    bundle: ModelBundle,
    path: str | Path,
    options: ExportOptions | None = None,
    progress: Progress = _noop,
    *,
    model: str = "",
    model_args: dict | None = None,
    model_dtype: str | None = None,
    **option_fields: Any,
) -> tuple[Path, StrippedProgram, dict[str, float]]:
    """Export, run the passes and lower ``bundle`` to ``path``; returns timings in seconds:
    ``export_s``, ``passes_s`` (and ``pass_<name>_s`` per pass within it), ``compile_s`` (the whole lowering) and, for a ``.pt2``,
    ``compile_<method>_s`` per method (within ``compile_s``), ``compile_<method>_<stage>_s`` per
    :data:`~offgraph_export.lowering.aoti.COMPILE_STAGES` stage within those, and
    ``compile_package_s`` (writing the archive); ``progress`` is told each as its
    stage finishes, so a long export shows where its time goes while it runs. The
    model is exported for inference: its parameters stop requiring grad. ``options`` (or, for
    short, its fields as keywords: ``device="cuda"``) are resolved by
    :meth:`ExportOptions.resolve` (per-device defaults, every compatibility rule) before anything
    is traced. A model whose linears are quantized with torchao's weight-only configs keeps their
    values: they are converted to the stored form, the model traced with their dequantized values
    and the quantize pass stores them, recorded as ``quantize`` would (design section 11;
    ``frontends/torchao_weights.py``). ``model``, ``model_args``, ``model_dtype``: recorded in the
    specs for check/run."""
    if options is not None and option_fields:
        raise OptionError(f"give export options either as options= or as keywords, not both ({sorted(option_fields)})", "--help")
    wanted = options if options is not None else ExportOptions.parse(**option_fields)
    resolved = wanted.resolve(bundle.cache_config.max_write, batched=bundle.cache_config.max_sessions is not None)
    device = resolved.export_device
    model_info = {"model": model, "model_args": model_args or {}, "model_dtype": model_dtype}
    module = bundle.model.to(device).requires_grad_(False)
    quantize, group_size, quantize_others = resolved.quantize, resolved.group_size, True
    torchao = convert_torchao_weights(module)
    if torchao is not None:
        quantize, group_size, quantize_others = export_scheme(
            torchao, resolved.quantize, wanted.group_size, resolved.format == "pt2",
            head_group=resolved.group_size if resolved.quantize_lm_head in GROUPED_SCHEMES else None,
        )
        progress(f"{len(torchao.stored)} torchao weights taken as they are ({torchao.described})")
    inputs = _fit_width(bundle.example_inputs, bundle.token_dims, bundle.cache_config.max_write, device)
    timings: dict[str, float] = {}
    progress("exporting")
    t0 = time.perf_counter()
    with float_stand_ins(module, torchao) if torchao is not None else nullcontext():
        ep = export_model(module, inputs, bundle.token_dims, bundle.cache_config.max_write)
    timings["export_s"] = time.perf_counter() - t0
    progress(f"exported in {timings['export_s']:.1f}s")
    progress(f"running passes (step impl: {resolved.step_impl})")
    t0 = time.perf_counter()
    program = run_passes(
        ep, inputs, bundle.cache_config, resolved.step_impl, fuse=resolved.fuse_projections,
        decode_method=resolved.decode_method, decode_gemv=resolved.decode_gemv, decode_rope=resolved.decode_rope,
        decode_sessions=resolved.decode_sessions, quantize=quantize, group_size=group_size,
        progress=progress, stored=torchao.stored if torchao is not None else None, quantize_others=quantize_others,
        quantize_lm_head=resolved.quantize_lm_head, lowering_traces=resolved.format == "pt2",
        cpu_int8_kernel=takes_cpu_int8_kernel(resolved.format, resolved.device, quantize, resolved.quantize_lm_head),
        cpu_int4_kernel=takes_cpu_int4_kernel(resolved.format, resolved.device, quantize, resolved.quantize_lm_head),
    )
    timings["passes_s"] = time.perf_counter() - t0
    timings.update({f"pass_{name}_s": seconds for name, seconds in program.pass_seconds.items()})
    progress(f"passes done in {timings['passes_s']:.1f}s")
    progress(f"compiling ({resolved.format}) for {resolved.device} (tens of seconds per method)")
    t0 = time.perf_counter()
    method_seconds: dict[str, float] = {}
    stage_seconds: dict[str, float] = {}
    out = lower(
        program, path, resolved.device, format=resolved.format, executorch_backend=resolved.executorch_backend,
        max_autotune=resolved.max_autotune, progress=progress, method_seconds=method_seconds,
        stage_seconds=stage_seconds, **model_info,
    )
    timings["compile_s"] = time.perf_counter() - t0
    timings.update({f"compile_{method}_s": seconds for method, seconds in method_seconds.items()})
    timings.update({f"compile_{stage}_s": seconds for stage, seconds in stage_seconds.items()})
    progress(f"compiled in {timings['compile_s']:.1f}s")
    return out, program, timings
