"""The edges of a captured CUDA graph, read and made programmatic after the capture.

AOTInductor launches every kernel with ``cuLaunchKernel``, no launch attributes, so a captured
step has only full dependencies. The CUDA driver (12.3+) lets a graph's edges carry a type: an edge
from kernel A into kernel B made *programmatic* lets B's programs be scheduled while A runs, B's
``griddepcontrol.wait`` then waiting for A to finish (``kernels/triton_base.wait_for_inputs``).
That is safe only where B waits before it reads or writes anything, and a kernel's name does not
say whether its wait was compiled in (Triton names the entry after the Python function whatever
its constexprs): the caller's ``waits`` must admit only kernels it knows were compiled with it.
No runtime path calls this yet: ``scripts/bench_pdl.py`` measures it and a cuda test
(``tests/test_quantized_gemv.py``) counts the edges it makes (docs/design.md, section 5). Driver
API through ctypes (``libcuda.so.1``).

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    changed = make_programmatic(graph.raw_cuda_graph(), lambda name: name in KERNELS_THAT_WAIT)
    graph.instantiate()
"""

from __future__ import annotations

import ctypes
import functools
from collections import Counter
from collections.abc import Callable

__all__ = ["PROGRAMMATIC", "edge_types", "kernel_names", "make_programmatic"]

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
#: CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (0: a full dependency)
PROGRAMMATIC = 1


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _Driver:
    """The driver calls used here; each raises ``RuntimeError`` naming the call on a failure."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed with CUresult {code}")

    def tries(self, name: str, *args) -> bool:
        return getattr(self.lib, name)(*args) == 0


@functools.cache
def _driver() -> _Driver:
    return _Driver()


def _name(call: _Driver, node: int) -> str:
    """A kernel node's function name: by its ``CUfunction`` (Triton's and AOTInductor's launches)
    or, where the node holds a ``CUkernel`` instead (runtime launches), by that; "" where neither
    tells (such a kernel is taken not to wait)."""
    params = _KernelParams()
    call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
    name = ctypes.c_char_p()
    if params.func and call.tries("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func)):
        return (name.value or b"").decode()
    if params.kern and call.tries("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern)):
        return (name.value or b"").decode()
    return ""


def kernel_names(graph: int) -> dict[int, str]:
    """The graph's kernel nodes (handles) and their functions' names."""
    call = _driver()
    count = ctypes.c_size_t(0)
    call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
    names = {}
    for node in nodes[: count.value]:
        kind = ctypes.c_int(-1)
        call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value == _KERNEL_NODE:
            names[node] = _name(call, node)
    return names


def _edges(call: _Driver, graph: int):
    count = ctypes.c_size_t(0)
    call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), None, None, None, ctypes.byref(count))
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count))
    return [(src[i], dst[i], _EdgeData.from_buffer_copy(data[i])) for i in range(min(n, count.value))]


def edge_types(graph: int) -> Counter:
    """How many of the graph's edges have each dependency type (0 full, :data:`PROGRAMMATIC`)."""
    return Counter(data.type for _, _, data in _edges(_driver(), graph))


def make_programmatic(graph: int, waits: Callable[[str], bool]) -> int:
    """Turn every full edge from a kernel node into a kernel node whose function ``waits`` (by
    name; see the module docstring) into a programmatic edge; returns how many changed. Call
    before ``instantiate``. An edge whose new form the driver refuses is put back as it was."""
    call = _driver()
    kernels = kernel_names(graph)
    changed = 0
    for a, b, old in _edges(call, graph):
        if a not in kernels or b not in kernels or not waits(kernels[b]) or old.type != 0:
            continue
        new = _EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0, type=PROGRAMMATIC)
        one_a, one_b = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
        g = ctypes.c_void_p(graph)
        call("cuGraphRemoveDependencies_v2", g, one_a, one_b, ctypes.byref(old), ctypes.c_size_t(1))
        if not call.tries("cuGraphAddDependencies_v2", g, one_a, one_b, ctypes.byref(new), ctypes.c_size_t(1)):
            call("cuGraphAddDependencies_v2", g, one_a, one_b, ctypes.byref(old), ctypes.c_size_t(1))
            raise RuntimeError("cuGraphAddDependencies_v2 refused a programmatic edge (the full edge was put back)")
        changed += 1
    return changed
