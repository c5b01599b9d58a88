"""Lower a stripped program to an ExecuTorch ``.pte`` (CPU: portable kernels, or XNNPACK where it
applies; CUDA: ExecuTorch's AOTInductor-driven CUDA delegate), specs embedded.

The same stripped program as the ``.pt2``: model inputs, then the storage inputs the runtime binds.
Every XNNPACK delegate carries the specs as CompileSpecs with the same keys and encodings as the
``.pt2`` metadata: ``offgraph_kv_manifest`` (the manifest JSON) and ``offgraph_kv_step_width``. A
delegate sees its own inputs, in its own order, so its width spec is computed from the partitioned
program (which of the delegate's inputs carries the token width, along which dim) and verified
again on the serialized program (:func:`~offgraph_export.specs.pte.check_delegate_specs`, as every
reader of the file checks it; :func:`delegate_width_specs` lists them); a delegate none of whose inputs
carries the width gets the manifest only. The whole program also carries the specs as constant
methods of the program (ExecuTorch's own way to attach values to a ``.pte``): ``offgraph_kv_step_width`` (the
``"input_index:dim"`` text), ``offgraph_kv_manifest`` (the manifest JSON), ``offgraph_program`` (the
program description) and ``offgraph_specs`` (the whole :class:`ArtifactSpecs` JSON), read back by
:mod:`offgraph_export.specs.pte` (which the runtime may import; this module it may not).

The program also records its digest (``offgraph_digest``, and for the cuda backend the data file's,
``offgraph_data_digest``): they are given as placeholders of their final length, and once the
program is serialized (and the data file written) :func:`~offgraph_export.specs.pte.seal_pte`
writes the digests into them. The sealed bytes then pass every check a reader makes
(:func:`~offgraph_export.specs.pte.check_pte`: the bounded layout, the digests, the constant
methods and every delegate's specs) before they are published, so an export never writes a file
its own reader refuses.

With the ``cuda`` backend the program is exported on the CPU and ``CudaPartitioner`` moves it to
the device and compiles it with AOTInductor; the compiled library and weights go to a separate
data file, written beside the ``.pte`` as ``<stem>.ptd`` (ExecuTorch's ``aoti_cuda_blob``), which a
CUDA-enabled ExecuTorch runtime loads with the program. The pip runtime has no CUDA backend, so
such a program can be built and inspected here but not run (:class:`~offgraph_export.runtime.pte_artifact.PteArtifact`
refuses it with that reason).

A program quantized as ``8da4w`` (design section 11) is partitioned by XNNPACK's dynamically
quantized partitioner first, then its general one (ExecuTorch's llama export's order), and is
refused when any quantization op is left outside an XNNPACK delegate (:func:`quantized_ops`): it
would not run as the quantized linear ``check`` compares against. Weight-only (``int8``/``int4``)
programs are refused by the options' rules (XNNPACK computes them wrongly).

ExecuTorch plans graph inputs into its own memory (``alloc_graph_input=True``, the default kept
here): the mutated storage comes back as the program's leading outputs and the caller's tensors are
not written, so the runtime copies those outputs back into its storage
(:class:`~offgraph_export.runtime.pte_artifact.PteArtifact`). ``alloc_graph_input=False`` would
silently keep a stale internal copy, so it is never used.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from torch.export import ExportedProgram

from offgraph_export.compat import fresh_int_array_names
from offgraph_export.errors import ArtifactError, ExportError
from offgraph_export.lowering.output_files import publish, staging
from offgraph_export.specs.artifact import ArtifactSpecs
from offgraph_export.options import BACKENDS, ExportOptions
from offgraph_export.specs.manifest import MANIFEST_KEY
from offgraph_export.specs.pte import check_pte, data_file_path, digest_placeholders, file_digest, seal_pte, spec_constants
from offgraph_export.specs.pte_reader import read_pte_layout
from offgraph_export.specs.step_width import STEP_WIDTH_KEY, StepWidthSpec, format_step_width, parse_step_width

__all__ = [
    "data_path",
    "compile_pte",
    "delegate_width_specs",
    "quantized_ops",
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


def _partitioners(backend: str, scheme: str | None = None) -> list:
    """The partitioners of ``backend``; for an 8da4w program (``scheme``) XNNPACK's dynamically
    quantized one first (it takes each quantized linear with its activation quantization, as
    ExecuTorch's llama export does), then the general one for the rest."""
    if backend == "portable":
        return []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackDynamicallyQuantizedPartitioner,
            XnnpackPartitioner,
        )

        return [XnnpackDynamicallyQuantizedPartitioner(), XnnpackPartitioner()] if scheme == "8da4w" else [XnnpackPartitioner()]
    if backend == "cuda":
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

        return [CudaPartitioner([CudaBackend.generate_method_name_compile_spec("forward")])]
    raise ExportError(f"unknown executorch backend {backend!r}; expected one of {BACKENDS}")


def data_path(path: str | os.PathLike) -> Path:
    """Where the external data of the ``.pte`` at ``path`` goes (``<stem>.ptd``, cuda backend)."""
    return data_file_path(path)


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


#: what names a quantization op in a node's target (torchao's, or the quantized_decomposed ones
#: the edge dialect may turn them into)
_QUANT_OP_MARKS = ("torchao", "quantized_decomposed", "quantize_affine", "choose_qparams")


def quantized_ops(gm: object) -> tuple[list[str], int]:
    """The quantization ops ``gm`` (an edge program's graph module) runs outside any delegate, by
    target name, and how many nodes of the delegates' own programs are such ops (what was
    delegated)."""
    outside: list[str] = []
    inside = 0
    for node in gm.graph.nodes:  # type: ignore[attr-defined]
        if node.op != "call_function":
            continue
        target = str(node.target)
        if "executorch_call_delegate" in target:
            lowered = getattr(gm, node.args[0].target)
            program = getattr(lowered, "original_module", None)
            if program is not None:
                inside += sum(
                    n.op == "call_function" and any(m in str(n.target) for m in _QUANT_OP_MARKS)
                    for n in program.graph.nodes
                )
        elif any(m in target for m in _QUANT_OP_MARKS):
            outside.append(target)
    return outside, inside


def _check_quantized_delegated(edge: object, specs: ArtifactSpecs) -> None:
    """An 8da4w program's quantized linears all went to XNNPACK: a quantization op left outside
    would run as a portable kernel (or not at all), not as the quantized linear checked."""
    if specs.quantization is None:
        return
    outside, inside = quantized_ops(edge.exported_program().graph_module)  # type: ignore[attr-defined]
    if outside or not inside:
        raise ExportError(
            f"--quantize {specs.quantization.scheme}: XNNPACK did not take every quantized linear "
            f"({len(outside)} quantization ops left outside its delegates, e.g. {sorted(set(outside))[:3]}; "
            f"{inside} inside)"
        )


def delegate_width_specs(buffer: bytes) -> list[tuple[int, StepWidthSpec | None, list[list[int]]]]:
    """For every delegate call of the serialized program: the delegate's index, its width spec
    (None without one) and the planned sizes of its arguments (``[]`` for one that is not a
    tensor), read back from the flatbuffer with the bounded reader."""
    layout = read_pte_layout(io.BytesIO(buffer), len(buffer), "the serialized program")
    out = []
    for delegate in layout.delegates:
        width = dict(delegate.compile_specs).get(STEP_WIDTH_KEY)
        spec = parse_step_width(width.decode()) if width else None
        for call in delegate.calls:
            out.append((delegate.index, spec, [list(sizes or ()) for sizes in call]))
    return out


def _sealed(buffer: bytes, specs: ArtifactSpecs, target: Path, data_file: Path | None) -> bytes:
    """``buffer`` with its digests written in, checked as a reader checks it."""
    try:
        sealed = seal_pte(buffer, None if data_file is None else file_digest(data_file), str(target))
        check_pte(io.BytesIO(sealed), len(sealed), str(target), data_file)
    except ArtifactError as exc:
        raise ExportError(f"the lowered program fails its own checks: {exc}") from exc
    return sealed


def compile_pte(
    ep: ExportedProgram, path: str | os.PathLike, specs: ArtifactSpecs, backend: str = "xnnpack"
) -> Path:
    """Lower ``ep`` (CPU) to the ``.pte`` at ``path``, written only when complete."""
    target = Path(path)
    if target.suffix != ".pte":
        raise ExportError(f"artifact path {str(target)!r} must end in .pte")
    # the backend's vocabulary and device, and the quantization a .pte takes (the rules live in options.py)
    quant = specs.quantization
    ExportOptions.parse(
        format="executorch", device=specs.device, executorch_backend=backend,
        quantize=quant.scheme if quant else "none", group_size=quant.group_size if quant else None,
    ).resolve()
    backend_config, to_edge_transform_and_lower = _executorch()
    grads = [name for name, p in ep.named_parameters() if p.requires_grad]
    if grads:
        raise ExportError(f"parameters {grads[:3]} require grad; export the model with requires_grad_(False)")
    extra = {}
    if backend == "cuda":
        from executorch.exir import EdgeCompileConfig

        extra["compile_config"] = EdgeCompileConfig(_check_ir_validity=False)
    try:
        constants = {**spec_constants(specs), **digest_placeholders(data_file=backend == "cuda")}
        with fresh_int_array_names():  # the cuda backend compiles through AOTInductor's C++ wrapper
            edge = to_edge_transform_and_lower(
                ep, partitioner=_partitioners(backend, quant.scheme if quant else None), constant_methods=constants,
                **extra,
            )
        _check_quantized_delegated(edge, specs)
        _attach_delegate_specs(edge, specs)
        program = edge.to_executorch(backend_config())
    except ExportError:
        raise
    except Exception as exc:  # exir raises many types; keep the cause chained
        raise ExportError(f"ExecuTorch lowering failed: {exc}") from exc
    with staging(target) as tmp_dir:
        program_file = tmp_dir / target.name
        moves = [(program_file, target)]
        blob = None
        if backend == "cuda":
            program.write_tensor_data_to_file(str(tmp_dir))
            blobs = sorted(tmp_dir.glob("*.ptd"))
            if len(blobs) != 1:
                raise ExportError(f"expected one external data file from the cuda backend, got {[b.name for b in blobs]}")
            blob = blobs[0]
            moves.insert(0, (blob, data_path(target)))  # the data first: the program names it
        program_file.write_bytes(_sealed(program.buffer, specs, target, blob))
        publish(moves, tmp_dir)
    return target
