"""What torch believes each of this project's Triton kernels writes.

``torch.library.triton_op`` + ``wrap_triton`` kernels are functionalized at export: torch's
mutation analysis (``triton_kernel_wrap.identify_accessed_tensors``, over the kernel's TTIR)
decides which pointer arguments a launch writes, and every tensor it names is cloned before the
launch (``tensors_to_clone``). A pointer the kernel only reads but the analysis calls written costs
a copy per call, and on torch 2.11 it made AOTInductor fail to compile the Triton step
(``decompose_triton_kernel_wrapper_functional``: "assert len(graph_with_eager_vals.graph.nodes)
== len(replacement.graph.nodes)", seen on the H200 2026-12-02 for the positions of the multi-token
kernels). The analysis walks back from every store's address through helper calls to all their
arguments, so a jit helper that takes a read-only pointer and returns part of a store address is
enough (``attend_common._tile_rows`` says how that was fixed).

This test runs torch's own analysis over every kernel launch the step implementations, the paged
step and the GEMV make, as the host code makes them, and pins the written set to the pointers each
kernel stores through. Without a GPU, Triton is given the H200's target (``GPUTarget("cuda", 90,
32)``) to lower the kernels to TTIR: the analysis reads the IR only; nothing is compiled or run.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_testing import HAVE_CUDA, HAVE_TRITON, INTERPRETING

pytestmark = pytest.mark.skipif(not HAVE_TRITON or INTERPRETING, reason="needs triton (not interpreted)")

#: pointer arguments each kernel writes, and nothing else
WRITES = {
    "_write_rows_kernel": {"k_store_ptr", "v_store_ptr"},
    "_attend_kernel": {"out_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr"},
    "_combine_splits_kernel": {"out_ptr"},
    "_decode_attend_kernel": {"k_store_ptr", "v_store_ptr", "out_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr"},
    "_decode_combine_kernel": {"out_ptr"},
    "_paged_write_kernel": {"k_store_ptr", "v_store_ptr"},
    "_paged_attend_kernel": {"out_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr"},
    "_paged_attend_kernel+FOLD_WRITE": {"k_store_ptr", "v_store_ptr", "out_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr"},
    "_paged_combine_kernel": {"out_ptr"},
    "_gemv_kernel": {"out_ptr"},
    "_gemv_tiles_kernel": {"out_ptr"},
    "_gemv_mma_kernel": {"out_ptr"},
}


class _H200Target:
    """Triton's driver interface as far as lowering to TTIR asks it (no GPU here)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def launches(monkeypatch):
    """Every (kernel, arguments) the host code launches, recorded instead of launched."""
    import triton

    if not HAVE_CUDA:  # the driver slot set_active fills (monkeypatch puts back what was there)
        monkeypatch.setattr(triton.runtime.driver, "_active", _H200Target())
    recorded = []

    class Record:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names = self.kernel.arg_names
                bound = dict(zip(names, args), **kwargs)
                recorded.append((self.kernel, {n: bound[n] for n in names if n in bound}))
            return launch

    monkeypatch.setattr(torch.library, "wrap_triton", Record)
    return recorded


def _all_launches() -> None:
    from offgraph_export.kernels import paged_attend, triton_gemv
    from offgraph_export.kernels.triton_attend import _lowered_step

    i32 = lambda *shape: torch.zeros(*shape, dtype=torch.int32)  # noqa: E731
    for t in (5, 1):  # the multi-token family, then the one-token one
        q, k, v = torch.randn(1, 4, t, 16), torch.randn(1, 2, t, 16), torch.randn(1, 2, t, 16)
        pos = torch.arange(t)
        for window in (None, 8):
            _lowered_step(q, k, v, pos, torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16), window, 0.25, torch.float32)
        if t == 1:  # the rotary fold
            _lowered_step(q, k, v, pos, torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16), None, 0.25,
                          torch.float32, torch.ones(16), torch.ones(16))
        paged_attend.paged_step(q, k, v, pos, torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 16), i32(t), i32(t),
                                i32(3, 64), i32(3), None, 0.25, torch.float32)
        paged_attend.paged_step(q, k, v, pos, torch.zeros(3, 2, 8, 16), torch.zeros(3, 2, 8, 16), i32(t), i32(t),
                                i32(3, 4), i32(3), 4, 0.25, torch.float32)
        if t == 1:  # the rotary fold of the paged one-token kernel
            paged_attend.paged_step(q, k, v, pos, torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 16), i32(t), i32(t),
                                    i32(3, 64), i32(3), None, 0.25, torch.float32, None, torch.ones(16), torch.ones(16))
    x, w = torch.randn(1, 1, 64), torch.randn(256, 64)
    triton_gemv.gemv_launch(x, w, torch.ones(64), 1e-5, torch.randn(1, 1, 128), gated=True)
    triton_gemv.gemv_launch(x, w, torch.ones(64), 1e-5, torch.randn(1, 1, 256))
    triton_gemv.gemv_launch(torch.randn(1, 1, 8192), torch.randn(64, 8192))
    # quantized rows (design section 11): scales, zeros and the bias read only, in every form and kernel
    from offgraph_export.reference.weight_quant import quantize

    q4, q8, bias = quantize(torch.randn(256, 64), "int4", 32), quantize(torch.randn(256, 64), "int8", None), torch.randn(256)
    int4 = dict(scales=q4.scales, zeros=q4.zeros, group_size=32)
    for config in ({"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4, "dequant": "bits", "x": "split"},
                   {"kernel": "tiles", "BLOCK_N": 4, "per_sm": 1, "num_warps": 4, "num_stages": 2, "dequant": "bits", "x": "split"},
                   {"kernel": "mma", "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}):
        triton_gemv.gemv_launch(x, q4.qweight, torch.ones(64), 1e-5, torch.randn(1, 1, 128), gated=True, config=config,
                                bias=bias, **int4)
        triton_gemv.gemv_launch(x, q4.qweight, torch.ones(64), 1e-5, torch.randn(1, 1, 256), config=config, bias=bias, **int4)
    triton_gemv.gemv_launch(x, q8.qweight, torch.ones(64), 1e-5, torch.randn(1, 1, 256), scales=q8.scales, bias=bias,
                            config={"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4, "dequant": "bits", "x": "split"})


def test_torch_sees_only_the_real_writes(launches):
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    _all_launches()
    seen = set()
    for kernel, kwargs in launches:
        name = kernel.fn.__name__ + ("+FOLD_WRITE" if kwargs.get("FOLD_WRITE") else "")
        accesses = identify_accessed_tensors(kernel, kwargs, {})
        written = {d.name for d in accesses.read_writes.writes if isinstance(kwargs.get(d.name), torch.Tensor)}
        assert written == WRITES[name], f"{name}: torch's analysis says it writes {sorted(written)}"
        seen.add(name)
    assert seen == set(WRITES), f"kernels never launched here: {sorted(set(WRITES) - seen)}"
