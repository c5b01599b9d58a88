"""Programmatic edges into a captured CUDA graph, after the capture (a prototype for the runtime).

AOTInductor launches every kernel with ``cuLaunchKernel``, no launch attributes, so a captured
step has only full dependencies. The CUDA driver (12.3+) lets a graph's edges carry a type: an edge
from kernel A into kernel B made *programmatic* lets B's programs be scheduled while A runs, B's
``griddepcontrol.wait`` then waiting for A to finish (``kernels/triton_base.wait_for_inputs``).
That is safe only where B waits before reading or writing anything, so only edges into kernels
known to do so (by function name) change. Driver API through ctypes (``libcuda.so.1``).

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    changed = make_programmatic(graph.raw_cuda_graph(), lambda name: name in PDL_KERNELS)
    graph.instantiate()
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_DEPENDENCY_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        code = getattr(lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed with CUresult {code}")

    return call


def kernel_names(graph: int) -> dict[int, str]:
    """The graph's kernel nodes (handles) and their functions' names."""
    call = _driver()
    count = ctypes.c_size_t(0)
    call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
    names = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != _KERNEL_NODE:
            continue
        params = _KernelParams()
        call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
        name = ctypes.c_char_p()
        call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
        names[node] = (name.value or b"").decode()
    return names


def make_programmatic(graph: int, waits: Callable[[str], bool]) -> int:
    """Turn every full edge from a kernel node into a kernel node whose function ``waits`` (by
    name) into a programmatic edge; returns how many changed. Call before ``instantiate``."""
    call = _driver()
    kernels = kernel_names(graph)
    count = ctypes.c_size_t(0)
    call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), None, None, None, ctypes.byref(count))
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count))
    changed = 0
    for i in range(count.value):
        a, b = src[i], dst[i]
        if a not in kernels or b not in kernels or not waits(kernels[b]) or data[i].type != 0:
            continue
        old = _EdgeData.from_buffer_copy(data[i])
        new = _EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0, type=_DEPENDENCY_PROGRAMMATIC)
        one_a, one_b = (ctypes.c_void_p * 1)(a), (ctypes.c_void_p * 1)(b)
        call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), one_a, one_b, ctypes.byref(old), ctypes.c_size_t(1))
        call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), one_a, one_b, ctypes.byref(new), ctypes.c_size_t(1))
        changed += 1
    return changed
