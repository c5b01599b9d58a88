"""Differences between the torch versions this package runs on (2.11 on the GPU machine, 2.13 in
CI), each an explicit feature check made once at import, never a ``try``/``except TypeError`` around
a call."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from pathlib import Path

import torch
import torch._inductor.config as _inductor_config
from torch.export import Dim, ExportedProgram

__all__ = [
    "AOTI_CHECKS_LOWERBOUND",
    "DIM_HINT_TAKES_RANGE",
    "DECOMPOSES_TRITON_OPS",
    "MODULE_CHECKS_GUARDS",
    "int_array_cache_keyed_by_bound_method",
    "aoti_shim_lacks",
    "aoti_shim_declares",
    "dynamic_dim",
    "decompose",
    "unlifted_module",
    "fresh_int_array_names",
]


def _accepts(fn: object, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature
        return False


#: ``Dim.DYNAMIC(min=..., max=...)``: range-carrying dynamic-shape hints.
DIM_HINT_TAKES_RANGE: bool = callable(Dim.DYNAMIC) and _accepts(type(Dim.DYNAMIC).__call__, "min")

#: ``ExportedProgram.run_decompositions(decompose_custom_triton_ops=...)``.
DECOMPOSES_TRITON_OPS: bool = _accepts(ExportedProgram.run_decompositions, "decompose_custom_triton_ops")

#: ``torch._inductor.config.aot_inductor.check_lowerbound``: whether a compiled wrapper's input
#: checks include each dynamic dim's lower bound (which AOTInductor puts at 2).
AOTI_CHECKS_LOWERBOUND: bool = hasattr(_inductor_config.aot_inductor, "check_lowerbound")

#: ``ExportedProgram.module(check_guards=...)``: the unlifted module may carry input guard checks.
MODULE_CHECKS_GUARDS: bool = _accepts(ExportedProgram.module, "check_guards")


def int_array_cache_keyed_by_bound_method(source: str | None = None) -> bool:
    """Whether AOTInductor's C++ wrapper caches its size/stride array names under ``id(writeline)``
    of a bound method (torch 2.11: a bound method is a new object at each access, and a later bound
    method of ANOTHER buffer can get its id, so a name declared inside one kernel launch's ``{ }``
    block is reused outside it and the wrapper fails to compile: ``int_array_871 was not declared in
    this scope``, seen building the 8B decode method on an H100, depending on addresses; torch 2.13
    keys on the buffer). Read from the installed ``codegen_int_array_var``'s ``source`` (given, or
    that of the installed torch, once); without its source, assumed for torch before 2.13."""
    if source is None:
        return _installed_int_array_cache_keyed_by_bound_method()
    return "id(writeline)" in source and "__self__" not in source


@functools.cache
def _installed_int_array_cache_keyed_by_bound_method() -> bool:
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

        source = inspect.getsource(CppWrapperCpu.codegen_int_array_var)
    except (ImportError, AttributeError, OSError, TypeError):  # no such method, or no source shipped
        return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    return int_array_cache_keyed_by_bound_method(source)


@contextlib.contextmanager
def fresh_int_array_names(force: bool = False) -> Iterator[None]:
    """While open (on a torch whose wrapper caches array names under a bound method's id,
    :func:`int_array_cache_keyed_by_bound_method`, or with ``force``), every size/stride array the
    C++ wrapper uses is declared afresh right where it is used (what the cache does on a miss), so
    no name can leak out of the block that declares it. Costs a few more wrapper lines; changes
    nothing else. Not for use from several threads at once (it replaces a class attribute)."""
    if not (force or int_array_cache_keyed_by_bound_method()):
        yield
        return
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.__dict__.get("codegen_int_array_var")  # None: inherited

    def codegen_int_array_var(self, int_array, writeline, known_statically=False, graph=None):  # type: ignore[no-untyped-def]
        return self._codegen_int_array_var_impl(int_array, writeline, known_statically)

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var  # type: ignore[method-assign]
    try:
        yield
    finally:
        if original is None:
            del CppWrapperCpu.codegen_int_array_var
        else:
            CppWrapperCpu.codegen_int_array_var = original  # type: ignore[method-assign]


def unlifted_module(ep: ExportedProgram) -> object:
    """``ep.module()`` without input guard checks, as AOTInductor's own packaging compiles it (the
    runtime checks inputs against the specs itself)."""
    return ep.module(check_guards=False) if MODULE_CHECKS_GUARDS else ep.module()


def dynamic_dim(lo: int, hi: int | None) -> object:
    """A dynamic dimension hint with a range.

    ``Dim.DYNAMIC`` rather than a named strict ``Dim``: masked attention over storage produces
    guards such as ``T*min(16, 32*T) == 16*T`` (from contiguity checks) that hold on the whole
    range but that the strict solver cannot prove (seen on torch 2.11 with CUDA). A hint accepts
    such guards and still fails if the dimension would be specialized to a constant. Without
    range support the hint is unbounded and the ranges are enforced by the runtime's admission.
    """
    if not DIM_HINT_TAKES_RANGE:
        return Dim.DYNAMIC
    return Dim.DYNAMIC(min=lo, max=hi) if hi is not None else Dim.DYNAMIC(min=lo)


def decompose(ep: ExportedProgram, table: "dict | None" = None) -> ExportedProgram:
    """``run_decompositions`` that also decomposes ``triton_op`` custom ops into their kernels
    (where torch can), so AOTInductor compiles the kernels instead of calling the op by name;
    ``table``: further ops to decompose (op overload -> its aten form)."""
    if DECOMPOSES_TRITON_OPS:
        return ep.run_decompositions(dict(table or {}), decompose_custom_triton_ops=True)
    return ep.run_decompositions(dict(table or {}))



def program_copy(ep: ExportedProgram, own_weights: bool = False) -> ExportedProgram:
    """A new program over a copy of ``ep``'s graph (node names kept, so the copied signature still
    names them) that shares its weights and constants: a pass may then edit the graph in place
    without touching ``ep`` (an earlier pass's result, which later passes read again).
    ``own_weights``: the copy's state dict is its own (the same tensors), for a pass that adds
    weights. ``ExportedProgram._update`` (torch 2.3 to 2.13) builds it the way export's own
    passes do."""
    import copy

    graph = copy.deepcopy(ep.graph)
    module = torch.fx.GraphModule(ep.graph_module, graph)
    assert [n.name for n in graph.nodes] == [n.name for n in ep.graph.nodes]
    return ep._update(module, copy.deepcopy(ep.graph_signature), state_dict=dict(ep.state_dict) if own_weights else None)


def _shim_header(name: str) -> str:
    """The text of AOTInductor's C shim header ``name`` (under ``aoti_torch/``) as torch ships it;
    empty where it is absent."""
    header = Path(torch.__file__).parent / "include/torch/csrc/inductor/aoti_torch" / name
    return header.read_text(encoding="utf-8", errors="replace") if header.is_file() else ""


def aoti_shim_declares(function: str) -> bool:
    """Whether AOTInductor's hand-written CPU C shim declares ``function``
    (``aoti_torch_cpu__weight_int4pack_mm_cpu_tensor``: torch 2.13's ``c/shim_cpu.h`` does);
    False where the header is absent."""
    return f"{function}(" in _shim_header("c/shim_cpu.h")


def aoti_shim_lacks(device: str, op_names: "list[str]") -> list[str]:
    """Which of the aten ops ``op_names`` (``_grouped_mm``) AOTInductor's C shim for ``device``
    does not declare, so that a package calling them fails to compile (torch 2.11's CUDA shim
    lacks ``_grouped_mm``, which transformers' mixture-of-experts layers call; 2.13's has it).
    Read from the shim header torch ships; none where the header is absent (nothing known)."""
    text = _shim_header(f"generated/c_shim_{device}.h")
    if not text:
        return []
    return [name for name in op_names if f"aoti_torch_{device}_{name}(" not in text]
