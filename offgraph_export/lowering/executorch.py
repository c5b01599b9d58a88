"""Lower a stripped program to an ExecuTorch ``.pte`` (CPU: portable kernels, or XNNPACK where it
applies; CUDA: ExecuTorch's AOTInductor-driven CUDA delegate), specs embedded.

The same stripped program as the ``.pt2``: model inputs, then the storage inputs the runtime binds.
Every XNNPACK delegate carries the specs as CompileSpecs with the same keys and encodings as the
``.pt2`` metadata: ``offgraph_kv_manifest`` (the manifest JSON) and ``offgraph_kv_step_width``. A
delegate sees its own inputs, in its own order, so its width spec is computed from the partitioned
program (which of the delegate's inputs carries the token width, along which dim) and verified
again on the serialized program (:func:`delegate_width_specs`); a delegate none of whose inputs
carries the width gets the manifest only. The whole program also carries the specs as constant
methods of the program (ExecuTorch's own way to attach values to a ``.pte``): ``offgraph_kv_step_width`` (the
``"input_index:dim"`` text), ``offgraph_kv_manifest`` (the manifest JSON), ``offgraph_program`` (the
program description) and ``offgraph_specs`` (the whole :class:`ArtifactSpecs` JSON), read back by
:mod:`offgraph_export.specs.pte` (which the runtime may import; this module it may not).

With the ``cuda`` backend the program is exported on the CPU and ``CudaPartitioner`` moves it to
the device and compiles it with AOTInductor; the compiled library and weights go to a separate
data file, written beside the ``.pte`` as ``<stem>.ptd`` (ExecuTorch's ``aoti_cuda_blob``), which a
CUDA-enabled ExecuTorch runtime loads with the program. The pip runtime has no CUDA backend, so
such a program can be built and inspected here but not run (:class:`~offgraph_export.runtime.pte_artifact.PteArtifact`
refuses it with that reason).

ExecuTorch plans graph inputs into its own memory (``alloc_graph_input=True``, the default kept
here): the mutated storage comes back as the program's leading outputs and the caller's tensors are
not written, so the runtime copies those outputs back into its storage
(:class:`~offgraph_export.runtime.pte_artifact.PteArtifact`). ``alloc_graph_input=False`` would
silently keep a stale internal copy, so it is never used.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.lowering.output_files import publish, staging
from offgraph_export.specs.artifact import ArtifactSpecs
from offgraph_export.options import BACKENDS, ExportOptions
from offgraph_export.specs.manifest import MANIFEST_KEY
from offgraph_export.specs.pte import spec_constants
from offgraph_export.specs.step_width import STEP_WIDTH_KEY, StepWidthSpec, format_step_width, parse_step_width

__all__ = [
    "data_path",
    "compile_pte",
    "delegate_width_specs",
]


def _executorch():
    try:
        from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
        from executorch.exir.passes import MemoryPlanningPass
    except ImportError as exc:
        raise ExportError(
            f"--format executorch needs executorch (pip install 'offgraph-export[executorch]'): {exc}"
        ) from exc

    def backend_config() -> object:
        # alloc_graph_input=True (the default, said aloud): inputs are copied into planned memory
        # and mutated storage comes back as outputs; False would keep a stale internal copy.
        return ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=True))

    return backend_config, to_edge_transform_and_lower


def _partitioners(backend: str) -> list:
    if backend == "portable":
        return []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if backend == "cuda":
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

        return [CudaPartitioner([CudaBackend.generate_method_name_compile_spec("forward")])]
    raise ExportError(f"unknown executorch backend {backend!r}; expected one of {BACKENDS}")


def data_path(path: str | os.PathLike) -> Path:
    """Where the external data of the ``.pte`` at ``path`` goes (``<stem>.ptd``, cuda backend)."""
    return Path(path).with_suffix(".ptd")


def _attach_delegate_specs(edge: object, specs: ArtifactSpecs) -> None:
    """Give every delegate its own CompileSpecs (the partitioner shares one list among them)."""
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    width_symbol = specs.width_symbol
    gm = edge.exported_program().graph_module  # type: ignore[attr-defined]
    for node in gm.graph.nodes:
        if node.op != "call_function" or "executorch_call_delegate" not in str(node.target):
            continue
        lowered = getattr(gm, node.args[0].target)
        own = [CompileSpec(MANIFEST_KEY, specs.manifest.to_json().encode())]
        for index, arg in enumerate(node.args[1:]):
            value = arg.meta.get("val") if hasattr(arg, "meta") else None
            dims = [d for d, size in enumerate(getattr(value, "shape", ())) if str(size) == width_symbol]
            if dims:
                own.append(CompileSpec(STEP_WIDTH_KEY, format_step_width(index, dims[0]).encode()))
                break
        lowered._compile_specs = [*lowered.compile_specs, *own]  # a list of its own, not the shared one


def delegate_width_specs(buffer: bytes) -> list[tuple[int, StepWidthSpec | None, list[list[int]]]]:
    """For every delegate call of the serialized program: the delegate's index, its width spec
    (None without one) and the planned sizes of its arguments, read back from the flatbuffer."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(buffer)
    program = getattr(program, "program", program)
    plan = next(p for p in program.execution_plan if p.name == "forward")
    out = []
    for chain in plan.chains:
        for instruction in chain.instructions:
            call = instruction.instr_args
            if type(call).__name__ != "DelegateCall":
                continue
            specs = {s.key: s.value for s in plan.delegates[call.delegate_index].compile_specs}
            width = specs.get(STEP_WIDTH_KEY)
            sizes = [list(getattr(plan.values[a].val, "sizes", [])) for a in call.args]
            out.append((call.delegate_index, parse_step_width(bytes(width).decode()) if width else None, sizes))
    return out


def _verify_delegate_widths(buffer: bytes, specs: ArtifactSpecs) -> None:
    """On the serialized program: each delegate's width spec names one of its arguments whose
    planned extent along that dim is the width's upper bound (``max_write``)."""
    bound = specs.symbols[specs.width_symbol].max
    for index, width, sizes in delegate_width_specs(buffer):
        if width is None:
            continue
        arg = sizes[width.input_index] if width.input_index < len(sizes) else []
        if width.dim >= len(arg) or arg[width.dim] != bound:
            raise ExportError(
                f"delegate {index}: width spec {width.format()!r} names an argument of planned "
                f"sizes {arg}, not one of token width up to {bound}"
            )


def compile_pte(
    ep: ExportedProgram, path: str | os.PathLike, specs: ArtifactSpecs, backend: str = "xnnpack"
) -> Path:
    """Lower ``ep`` (CPU) to the ``.pte`` at ``path``, written only when complete."""
    target = Path(path)
    if target.suffix != ".pte":
        raise ExportError(f"artifact path {str(target)!r} must end in .pte")
    # the backend's vocabulary and device (the rules live in options.py)
    ExportOptions.parse(format="executorch", device=specs.device, executorch_backend=backend).resolve()
    backend_config, to_edge_transform_and_lower = _executorch()
    grads = [name for name, p in ep.named_parameters() if p.requires_grad]
    if grads:
        raise ExportError(f"parameters {grads[:3]} require grad; export the model with requires_grad_(False)")
    extra = {}
    if backend == "cuda":
        from executorch.exir import EdgeCompileConfig

        extra["compile_config"] = EdgeCompileConfig(_check_ir_validity=False)
    try:
        edge = to_edge_transform_and_lower(
            ep, partitioner=_partitioners(backend), constant_methods=spec_constants(specs), **extra
        )
        _attach_delegate_specs(edge, specs)
        program = edge.to_executorch(backend_config())
    except ExportError:
        raise
    except Exception as exc:  # exir raises many types; keep the cause chained
        raise ExportError(f"ExecuTorch lowering failed: {exc}") from exc
    _verify_delegate_widths(program.buffer, specs)
    with staging(target) as tmp_dir:
        program_file = tmp_dir / target.name
        program_file.write_bytes(program.buffer)
        moves = [(program_file, target)]
        if backend == "cuda":
            program.write_tensor_data_to_file(str(tmp_dir))
            blobs = sorted(tmp_dir.glob("*.ptd"))
            if len(blobs) != 1:
                raise ExportError(f"expected one external data file from the cuda backend, got {[b.name for b in blobs]}")
            moves.insert(0, (blobs[0], data_path(target)))  # the data first: the program names it
        publish(moves, tmp_dir)
    return target
