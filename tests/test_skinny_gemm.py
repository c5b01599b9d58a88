"""The few-row GEMM (``kernels/triton_skinny_gemm.py``, a launch the sweep measures) against a
float64 recompute over ``W'``: float, int8 and int4 (groups of 32 and 128) weights, 1-16 rows of
``x``, a partial last block of rows and of columns; in the Triton interpreter on CPU (fp32, whose
``tl.dot`` runs in full precision there) and in bf16 on cuda.

``test_interp_*`` run in a child with ``TRITON_INTERPRET=1`` (``test_skinny_gemm_interpreter_suite``)."""

from __future__ import annotations

import pytest
import torch

from offgraph_export.reference.weight_quant import dequantize, quantize
from tests.triton_testing import interpreter_only, needs_cuda, needs_triton, run_interpreter_cases

SCHEMES = [("none", None), ("int8", None), ("int4", 32), ("int4", 128)]


def _case(m: int, n: int, k: int, scheme: str, group: int | None, dtype: torch.dtype, device: str = "cpu"):
    """``x``, the stored weight's arguments and ``W'`` (the float weight itself when not quantized)."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device)
    if scheme == "none":
        return x, (w,), w
    stored = quantize(w, scheme, group)
    return x, (stored.qweight, stored.scales, stored.zeros, group or 0), dequantize(stored)


@interpreter_only
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m, n, k, config", [
    (1, 40, 256, (16, 128, 4, 2)),  # BLOCK_K raised to a group of 128
    (5, 40, 1152, (16, 256, 4, 2)),  # a partial last block of weight rows and of columns
    (16, 96, 1152, (32, 128, 4, 3)),
])
def test_interp_skinny_gemm_bits_form_matches_a_float64_recompute(m, n, k, config, group):
    """int4's "bits" form (``1 + q / 16`` by integer logic, one dot a group, the group's scale and
    zero on its result) against the same float64 recompute over ``W'``, and not the float
    weight's result."""
    from offgraph_export.kernels.triton_skinny_gemm import skinny_gemm

    x, weight, w_prime = _case(m, n, k, "int4", group, torch.float32)
    got = skinny_gemm(x, *weight, config=config, dequant="bits")
    want = x.double() @ w_prime.double().T
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(m * 1000 + k)
    torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    assert (got.double() - x.double() @ w.double().T).abs().max() > 1e-4


def test_skinny_gemm_refuses_a_bits_form_it_has_not():
    from offgraph_export.kernels.triton_skinny_gemm import skinny_gemm

    stored = quantize(torch.randn(8, 64), "int8", None)
    with pytest.raises(ValueError, match="not int8 weights"):
        skinny_gemm(torch.randn(2, 64), stored.qweight, stored.scales, dequant="bits")
    with pytest.raises(ValueError, match="not 'bit'"):
        skinny_gemm(torch.randn(2, 64), torch.randn(8, 64), dequant="bit")


@needs_triton
def test_skinny_gemm_interpreter_suite():
    run_interpreter_cases(__file__)


@interpreter_only
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("m, n, k, config", [
    (1, 40, 256, (16, 128, 4, 2)),
    (5, 40, 1152, (16, 256, 4, 2)),  # a partial last block of weight rows and of columns
    (16, 96, 1152, (32, 128, 4, 3)),
])
def test_interp_skinny_gemm_matches_a_float64_recompute(m, n, k, config, scheme, group):
    from offgraph_export.kernels.triton_skinny_gemm import skinny_gemm

    x, weight, w_prime = _case(m, n, k, scheme, group, torch.float32)
    got = skinny_gemm(x, *weight, config=config)
    want = x.double() @ w_prime.double().T
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_skinny_gemm_refuses_more_rows_than_a_tile_and_a_group_that_does_not_divide():
    from offgraph_export.kernels.triton_skinny_gemm import MAX_ROWS, skinny_gemm

    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows, not 17"):
        skinny_gemm(torch.randn(17, 64), torch.randn(8, 64))
    stored = quantize(torch.randn(8, 64), "int4", 32)
    with pytest.raises(ValueError, match="group size 48 must divide 64"):
        skinny_gemm(torch.randn(2, 64), stored.qweight, stored.scales, stored.zeros, 48)


@pytest.mark.cuda  # scripts/gpu_*.sh select the cuda tests by this mark (without it this test never ran there)
@needs_cuda
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 8192), (16384, 2048)])
def test_skinny_gemm_matches_on_cuda(n, k, m, scheme, group):
    """bf16 at the Llama-1B shapes, every launch of the sweep: as close to a float64 recompute
    over ``W'`` as cuBLAS's bf16 GEMM over ``W'`` is (within 2x, plus a little)."""
    from offgraph_export.kernels.triton_skinny_gemm import SKINNY_CONFIGS, skinny_gemm

    x, weight, w_prime = _case(m, n, k, scheme, group, torch.bfloat16, "cuda")
    want = x.double() @ w_prime.double().T
    eager_err = ((x @ w_prime.T).double() - want).norm() / want.norm()
    forms = ("value", "bits") if scheme == "int4" else ("value",)
    for config in SKINNY_CONFIGS:
        for form in forms:
            got = skinny_gemm(x, *weight, config=config, dequant=form)
            err = (got.double() - want).norm() / want.norm()
            assert err <= 2 * eager_err + 1e-3, (config, form, err.item(), eager_err.item())
