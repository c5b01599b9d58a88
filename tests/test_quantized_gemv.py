"""The decode GEMV over quantized weights (docs/design.md section 11) and with a bias: the kernel
dequantizing int8 / int4 in registers against the float folds over the reference rule's ``W'``
(in the Triton interpreter on CPU, and in bf16 on cuda), the bias added before the output's
rounding; ``decode_gemv`` taking every quantized linear of the example's decode method, the lm_head
included, with its folds, and a Qwen2 model's biased q|k|v projections.

``test_interp_*`` run in a child with ``TRITON_INTERPRET=1`` (``test_quantized_gemv_interpreter_suite``)."""

from __future__ import annotations

import pytest
import torch

from offgraph_export.reference.weight_quant import dequantize, quantize
from tests.test_triton_attend import FOLDS, _eager_folds, _fold_inputs
from tests.triton_testing import interpreter_only, needs_cuda, needs_triton, run_interpreter_cases

SCHEMES = [("int8", None), ("int4", 32), ("int4", 128)]


def _quantized(w: torch.Tensor, scheme: str, group: int | None):
    stored = quantize(w, scheme, group)
    return stored, dequantize(stored)


@needs_triton
def test_quantized_gemv_interpreter_suite():
    run_interpreter_cases(__file__)


@interpreter_only
@pytest.mark.parametrize("dequant", ["value", "group", "bits"])
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS)
@pytest.mark.parametrize("n, k", [(40, 256), (96, 1152)])  # 1152: a partial last chunk of columns
def test_interp_quantized_gemv_matches_the_float_folds_over_w_prime(n, k, norm, gated, gate_first, residual, scheme, group, dequant):
    """The three dequantization forms (per row or group, the default; per value and "bits", launch
    options) against the float folds over ``W'`` (fp32: rounding ``W'`` to the dtype is exact).
    One tolerance for all: "bits" adds fp32 rounding only, most for int4, whose sums of ``(128 +
    q) x`` are about 17 times the group form's ``q x`` before the zero term cancels the 128 (at
    most 0.82 of the tolerance here, against 0.05 for "group")."""
    from offgraph_export.kernels.triton_gemv import _config, gemv_launch

    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    stored, w_prime = _quantized(w, scheme, group)
    config = _config(k, gated, quantized=4 if group else 8, n=n) | {"dequant": dequant}
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    # and not the float weight's result: the kernel really reads the stored form
    assert (got - _eager_folds(x, w, nw, 1e-5, res, gated, gate_first)).abs().max() > 1e-4


@interpreter_only
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS[:3])
def test_interp_wide_projection_configuration_matches_the_float_folds(norm, gated, gate_first, residual, scheme, group):
    """The launch configuration the default gives wide quantized projections on a small weight,
    against ``W'``: an lm_head (not gated) with rows up to 2048 columns takes the persistent kernel
    in the "bits" form, 4 rows a tile, so does int8's gate|up, 2 rows a tile; int4's gate|up and
    longer rows (the 8B shapes, not measured) take the rows kernel: int4 16 rows x 512 columns a
    program, "bits" with x split; int8 8 x 512, per row."""
    from offgraph_export.kernels.triton_gemv import _QUANT_WIDE_ROWS, _config, gemv_launch

    n, k = 48, 1152
    bits = 4 if group else 8
    config = _config(k, gated, quantized=bits, n=_QUANT_WIDE_ROWS)
    split = "split" if bits == 4 else None
    if bits == 4 and gated:
        assert (config["kernel"], config["BLOCK_N"], config["BLOCK_K"], config["dequant"], config["x"]) == ("rows", 16, 512, "bits", "split")
    else:
        tile_rows = 2 if gated else 4
        assert (config["kernel"], config["BLOCK_N"], config["dequant"], config.get("x")) == ("tiles", tile_rows, "bits", split)
    longer = _config(4096, gated, quantized=bits, n=_QUANT_WIDE_ROWS)
    want_longer = ("rows", 16, 512, "bits", "split") if bits == 4 else ("rows", 8, 512, "group", None)
    assert (longer["kernel"], longer["BLOCK_N"], longer["BLOCK_K"], longer["dequant"], longer.get("x")) == want_longer
    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    stored, w_prime = _quantized(w, scheme, group)
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


@interpreter_only
@pytest.mark.parametrize("scheme,group", [(None, None), ("int8", None), ("int4", 32)])
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS[:4])
def test_interp_gemv_with_a_bias_matches_eager(norm, gated, gate_first, residual, scheme, group):
    from offgraph_export.kernels.triton_gemv import triton_gemv

    n, k = 96, 256
    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
    if scheme is None:
        got = triton_gemv(x, w, nw, 1e-5, res, gated, gate_first, bias=bias)
        w_prime = w
    else:
        stored, w_prime = _quantized(w, scheme, group)
        got = triton_gemv(x, stored.qweight, nw, 1e-5, res, gated, gate_first, stored.scales, stored.zeros, group or 0, bias)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first, bias=bias)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


def _laid_out(qweight: torch.Tensor, layout: str) -> torch.Tensor:
    """``qweight`` as stored ("contiguous"), 1 byte into its buffer ("offset"), or in rows padded
    to a stride of 8 more bytes ("padded", still whole words) or 2 more ("stride2", not)."""
    n, width = qweight.shape
    if layout == "contiguous":
        return qweight
    if layout == "offset":
        buffer = torch.zeros(n * width + 4, dtype=qweight.dtype)
        out = buffer[1:1 + n * width].view(n, width)
    else:
        out = torch.zeros(n, width + (8 if layout == "padded" else 2), dtype=qweight.dtype)[:, :width]
    out.copy_(qweight)
    return out


@interpreter_only
@pytest.mark.parametrize("scheme, group, k, layout, form", [
    ("int8", None, 256, "contiguous", "bits"), ("int4", 32, 1152, "contiguous", "bits"),
    ("int8", None, 1152, "padded", "bits"), ("int4", 128, 1152, "padded", "bits"),  # word rows from the stride
    ("int8", None, 1150, "contiguous", "group"),  # K % 4: rows are not whole words
    ("int4", 4, 1148, "contiguous", "group"),  # K % 8 (a group of 4 divides it)
    ("int4", 4, 1152, "contiguous", "group"),  # whole words, but a group is half a word
    ("int8", None, 1152, "offset", "group"), ("int4", 32, 1152, "stride2", "group"),  # words not 4-byte aligned
])
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS[:4])
def test_interp_bits_form_with_a_bias_and_where_it_falls_back(norm, gated, gate_first, residual, scheme, group, k, layout, form):
    """``"dequant": "bits"`` with a bias, with row strides of whole words, and where it falls back
    to "group" (rows or int4 groups not whole aligned int32 words): every launch matches the
    float folds over ``W'``."""
    from offgraph_export.kernels.triton_gemv import _config, _dequant_form, gemv_launch

    n = 96
    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5))
    stored, w_prime = _quantized(w, scheme, group)
    qweight = _laid_out(stored.qweight, layout)
    config = _config(k, gated, quantized=4 if group else 8, n=n) | {"dequant": "bits"}
    assert _dequant_form(config, 4 if group else 8, qweight, k, group or 0) == form
    got = gemv_launch(x, qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0, bias=b)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first, bias=b)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    assert (got - _eager_folds(x, w, nw, 1e-5, res, gated, gate_first, bias=b)).abs().max() > 1e-4


#: the persistent row-tile kernel's quantized launches swept by scripts/bench_quantized_gemv.py, per
#: row or group and "bits"
TILES = [{"kernel": "tiles", "BLOCK_N": bn, "per_sm": 1, "num_warps": 4, "num_stages": 2} | form
         for form in ({}, {"dequant": "bits"}) for bn in (1, 4)]


def _tiles_id(config: dict) -> str:
    return f"tiles{config['BLOCK_N']}{config.get('dequant', '')}"


@interpreter_only
@pytest.mark.parametrize("config", TILES, ids=_tiles_id)
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS[:4])
@pytest.mark.parametrize("n, k, bias", [(600, 1152, True)])  # several tiles a program; K < BLOCK_K
def test_interp_tiles_kernel_reads_quantized_rows_like_the_float_folds(n, k, bias, norm, gated, gate_first, residual, scheme, group, config):
    """The persistent kernel (``x`` prepared once a program, int4's even and odd columns and group
    sums too, or for "bits" ``x`` at each field position of a word) over int8 / int4 rows, per row
    or group and "bits", with every fold and a bias, against ``W'``."""
    from offgraph_export.kernels.triton_gemv import _dequant_form, gemv_launch

    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5)) if bias else None
    stored, w_prime = _quantized(w, scheme, group)
    bits = _dequant_form(config, 4 if group else 8, stored.qweight, k, group or 0) == "bits"
    assert bits == (config.get("dequant") == "bits")
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0, bias=b)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first, bias=b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    assert (got - _eager_folds(x, w, nw, 1e-5, res, gated, gate_first, bias=b)).abs().max() > 1e-4


@interpreter_only
@pytest.mark.parametrize("scheme, group, k, layout, form", [
    ("int8", None, 1152, "padded", "bits"), ("int4", 128, 1152, "padded", "bits"),  # word rows from the stride
    ("int8", None, 1152, "offset", "group"), ("int4", 32, 1152, "stride2", "group"),  # words not 4-byte aligned
    ("int4", 4, 1152, "contiguous", "group"),  # a group is half a word
])
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS[:4])
def test_interp_tiles_kernel_bits_form_where_it_falls_back(norm, gated, gate_first, residual, scheme, group, k, layout, form):
    """The persistent kernel's ``"dequant": "bits"`` over rows padded to a stride of whole words,
    and where it falls back to reading by group (rows or int4 groups not whole aligned words):
    each launch matches the float folds over ``W'``."""
    from offgraph_export.kernels.triton_gemv import _dequant_form, gemv_launch

    n = 600
    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5))
    stored, w_prime = _quantized(w, scheme, group)
    qweight = _laid_out(stored.qweight, layout)
    config = TILES[3]
    assert config["dequant"] == "bits" and _dequant_form(config, 4 if group else 8, qweight, k, group or 0) == form
    got = gemv_launch(x, qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0, bias=b)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first, bias=b)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    assert (got - _eager_folds(x, w, nw, 1e-5, res, gated, gate_first, bias=b)).abs().max() > 1e-4


#: the "bits" launches of both kernels whose ``x`` the option ``"x": "split"`` changes
X_SPLIT_CONFIGS = [{"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "dequant": "bits"},
                   {"kernel": "tiles", "BLOCK_N": 4, "per_sm": 1, "num_warps": 4, "num_stages": 2, "dequant": "bits"},
                   {"kernel": "rows", "BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "dequant": "group"}]


def _x_split_id(config: dict) -> str:
    return f"{config['kernel']}-{config['dequant']}"


@interpreter_only
@pytest.mark.parametrize("config", X_SPLIT_CONFIGS, ids=_x_split_id)
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS)
def test_interp_x_split_reads_the_same_x_as_the_strided_fields(norm, gated, gate_first, residual, scheme, group, config):
    """``"x": "split"`` (the chunk's ``x`` read once and split in registers: into the words' field
    positions in the "bits" form, into int4's even and odd columns in the rows kernel's per-group
    form) gives exactly the sums of the launch that reads ``x`` at each position (the same values
    in the same order), and both match the float folds over ``W'``; 1152 columns: the rows
    kernel's last chunk partial, the tiles kernel's ``x`` past ``K`` masked."""
    from offgraph_export.kernels.triton_gemv import _dequant_form, gemv_launch

    n, k = 96, 1152
    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5))
    stored, w_prime = _quantized(w, scheme, group)
    assert _dequant_form(config, 4 if group else 8, stored.qweight, k, group or 0) == config["dequant"]
    launch = dict(scales=stored.scales, zeros=stored.zeros, group_size=group or 0, bias=b)
    fields = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, **launch)
    split = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config | {"x": "split"}, **launch)
    assert torch.equal(split, fields)
    with pytest.raises(ValueError, match="not 'splt'"):
        gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config | {"x": "splt"}, **launch)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first, bias=b)
    torch.testing.assert_close(split, want, atol=3e-5, rtol=3e-5)
    assert (split - _eager_folds(x, w, nw, 1e-5, res, gated, gate_first, bias=b)).abs().max() > 1e-4


#: the tensor-core kernel's launches swept by scripts/bench_quantized_gemv.py, two of them
MMA_CONFIGS = [{"kernel": "mma", "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
               {"kernel": "mma", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}]


@interpreter_only
@pytest.mark.parametrize("config", MMA_CONFIGS, ids=lambda c: f"{c['BLOCK_N']}x{c['BLOCK_K']}")
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS)
def test_interp_mma_kernel_matches_the_float_folds_over_w_prime(norm, gated, gate_first, residual, group, config):
    """``"kernel": "mma"`` (int4 on the tensor cores: ``x`` padded to 16 rows, one dot a group over
    ``1 + q / 16``, the group's scale and zero on its result) with every fold and a bias against the
    float folds over ``W'``; 1152 columns: with 256 a step the last one holds half its groups, and
    40 rows leave the last program's block partial."""
    from offgraph_export.kernels.triton_gemv import gemv_launch

    n, k = 40, 1152
    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5))
    stored, w_prime = _quantized(w, "int4", group)
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group, bias=b)
    want = _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first, bias=b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    assert (got - _eager_folds(x, w, nw, 1e-5, res, gated, gate_first, bias=b)).abs().max() > 1e-4


def test_mma_kernel_refuses_what_it_does_not_read():
    from offgraph_export.kernels.triton_gemv import gemv_launch

    w = torch.randn(8, 64)
    int8 = quantize(w, "int8", None)
    with pytest.raises(ValueError, match="not int8 weights"):
        gemv_launch(torch.randn(1, 1, 64), int8.qweight, config=MMA_CONFIGS[0], scales=int8.scales)
    int4 = quantize(w, "int4", 8)
    with pytest.raises(ValueError, match="groups of 8"):
        gemv_launch(torch.randn(1, 1, 64), int4.qweight, config=MMA_CONFIGS[0], scales=int4.scales, zeros=int4.zeros,
                    group_size=8)


#: (n, k) and folds at the Llama-1B shapes; the lm_head (128256 rows) is never gated
CUDA_CASES = [(n, k, *fold) for n, k in [(3072, 2048), (2048, 8192), (16384, 2048), (128256, 2048)]
              for fold in FOLDS[:4] if not (fold[1] and n > 16384)]


def _float64_and_eager(x, w_prime, nw, res, gated, gate_first):
    """The folds over ``W'`` recomputed in float64 (the oracle) and in eager at ``x``'s dtype."""
    want = _eager_folds(x.double(), w_prime.double(), None if nw is None else nw.double(), 1e-5,
                        None if res is None else res.double(), gated, gate_first)
    return want, _eager_folds(x, w_prime, nw, 1e-5, res, gated, gate_first)


def _assert_as_close_as_eager(got, want, eager):
    """``got`` is as close to the float64 ``want`` as eager bf16 is (within 1.5x, plus 1e-3)."""
    err = ((got.double() - want).norm() / want.norm()).item()
    eager_err = ((eager.double() - want).norm() / want.norm()).item()
    assert err <= 1.5 * eager_err + 1e-3, f"GEMV error {err:.2e} vs eager bf16 {eager_err:.2e}"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("n, k, norm, gated, gate_first, residual", CUDA_CASES)
def test_quantized_gemv_matches_on_cuda(n, k, norm, gated, gate_first, residual, scheme, group):
    """bf16 at the Llama-1B shapes (the lm_head's 128256 rows included): as close to a float64
    recompute over ``W'`` as eager bf16 over ``W'`` is."""
    from offgraph_export.kernels.triton_gemv import triton_gemv

    x, w, nw, res = _fold_inputs(n, k, torch.bfloat16, norm, gated, residual, device="cuda", seed=7)
    stored, w_prime = _quantized(w, scheme, group)
    want, eager = _float64_and_eager(x, w_prime, nw, res, gated, gate_first)
    got = triton_gemv(x, stored.qweight, nw, 1e-5, res, gated, gate_first, stored.scales, stored.zeros, group or 0)
    _assert_as_close_as_eager(got, want, eager)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("config", X_SPLIT_CONFIGS, ids=_x_split_id)
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("n, k, norm, gated, gate_first, residual", [c for c in CUDA_CASES if c[3] or c[5]])
def test_quantized_gemv_x_split_matches_on_cuda(n, k, norm, gated, gate_first, residual, scheme, group, config):
    """``"x": "split"`` compiled for the GPU, both kernels, at the Llama-1B shapes with a gated or
    residual fold (the down projection's 8192 columns among them): as close to a float64 recompute
    over ``W'`` as eager bf16 over ``W'`` is."""
    from offgraph_export.kernels.triton_gemv import gemv_launch

    x, w, nw, res = _fold_inputs(n, k, torch.bfloat16, norm, gated, residual, device="cuda", seed=7)
    stored, w_prime = _quantized(w, scheme, group)
    want, eager = _float64_and_eager(x, w_prime, nw, res, gated, gate_first)
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config | {"x": "split"}, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0)
    _assert_as_close_as_eager(got, want, eager)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("config", MMA_CONFIGS, ids=lambda c: f"{c['BLOCK_N']}x{c['BLOCK_K']}")
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("n, k, norm, gated, gate_first, residual", [c for c in CUDA_CASES if c[3] or c[5]])
def test_mma_kernel_matches_on_cuda(n, k, norm, gated, gate_first, residual, group, config):
    """``"kernel": "mma"`` compiled for the GPU in bf16 at the Llama-1B shapes with a gated or
    residual fold: as close to a float64 recompute over ``W'`` as eager bf16 over ``W'`` is."""
    from offgraph_export.kernels.triton_gemv import gemv_launch

    x, w, nw, res = _fold_inputs(n, k, torch.bfloat16, norm, gated, residual, device="cuda", seed=7)
    stored, w_prime = _quantized(w, "int4", group)
    want, eager = _float64_and_eager(x, w_prime, nw, res, gated, gate_first)
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group)
    _assert_as_close_as_eager(got, want, eager)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("n, k, norm, gated, gate_first, residual", CUDA_CASES)
def test_quantized_gemv_bits_form_matches_on_cuda(n, k, norm, gated, gate_first, residual, scheme, group):
    """``"dequant": "bits"`` in bf16 at the Llama-1B shapes (the rows kernel at each default's
    block, 8 rows x 512 columns for the lm_head, which defaults to the tiles kernel): as close to a
    float64 recompute over ``W'`` as eager bf16 over ``W'`` is."""
    from offgraph_export.kernels.triton_gemv import _config, _dequant_form, gemv_launch

    x, w, nw, res = _fold_inputs(n, k, torch.bfloat16, norm, gated, residual, device="cuda", seed=7)
    stored, w_prime = _quantized(w, scheme, group)
    want, eager = _float64_and_eager(x, w_prime, nw, res, gated, gate_first)
    config = _config(k, gated, quantized=4 if group else 8, n=n)
    if config["kernel"] != "rows":
        config = {"kernel": "rows", "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}
    config = config | {"dequant": "bits"}
    assert _dequant_form(config, 4 if group else 8, stored.qweight, k, group or 0) == "bits"
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0)
    _assert_as_close_as_eager(got, want, eager)


#: the persistent kernel's quantized CUDA cases at the Llama-1B shapes
TILES_CUDA_CASES = [(3072, 2048, True, False, True, False), (16384, 2048, True, True, True, False),
                    (2048, 8192, False, False, True, True), (128256, 2048, True, False, True, False)]


def _tiles_cuda_case(n, k, norm, gated, gate_first, residual, scheme, group, dequant):
    """The persistent kernel (4 rows a tile, ``dequant`` added to its launch) over quantized rows
    in bf16: as close to a float64 recompute over ``W'`` as eager is."""
    from offgraph_export.kernels.triton_gemv import _dequant_form, gemv_launch

    x, w, nw, res = _fold_inputs(n, k, torch.bfloat16, norm, gated, residual, device="cuda", seed=7)
    stored, w_prime = _quantized(w, scheme, group)
    want, eager = _float64_and_eager(x, w_prime, nw, res, gated, gate_first)
    config = {"kernel": "tiles", "BLOCK_N": 4, "per_sm": 4, "num_warps": 8 if k > 4096 else 4, "num_stages": 3} | dequant
    if dequant:
        assert _dequant_form(config, 4 if group else 8, stored.qweight, k, group or 0) == "bits"
    got = gemv_launch(x, stored.qweight, nw, 1e-5, res, gated, gate_first, config, scales=stored.scales,
                      zeros=stored.zeros, group_size=group or 0)
    _assert_as_close_as_eager(got, want, eager)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("n, k, norm, gated, gate_first, residual", TILES_CUDA_CASES)
def test_quantized_tiles_kernel_matches_on_cuda(n, k, norm, gated, gate_first, residual, scheme, group):
    """The persistent kernel over quantized rows in bf16 at the Llama-1B shapes (8 warps for the
    8192-column rows it holds whole): as close to a float64 recompute over ``W'`` as eager is."""
    _tiles_cuda_case(n, k, norm, gated, gate_first, residual, scheme, group, {})


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("n, k, norm, gated, gate_first, residual", TILES_CUDA_CASES)
def test_quantized_tiles_kernel_bits_form_matches_on_cuda(n, k, norm, gated, gate_first, residual, scheme, group):
    """The persistent kernel's ``"dequant": "bits"`` in bf16 at the same shapes (the lm_head's
    default tile launch among them), as close to a float64 recompute over ``W'`` as eager is."""
    _tiles_cuda_case(n, k, norm, gated, gate_first, residual, scheme, group, {"dequant": "bits"})


@needs_triton
def test_quantized_defaults_take_the_bits_form_where_the_sweep_found_it_faster():
    """The 1B shapes' default launches (H100 sweeps, triton_gemv's comment on ``_config``): int8
    reads words ("bits") on every projection, the tiles kernel for lm_head and gate|up; int4 reads
    words with x split in registers everywhere, the tiles kernel for the lm_head only; rows longer
    than 2048 columns keep the rows kernel."""
    from offgraph_export.kernels.triton_gemv import _config

    shapes = {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "gate|up": (16384, 2048, True),
              "down": (2048, 8192, False), "lm_head": (128256, 2048, False)}
    forms = {(name, bits): tuple(_config(k, gated, bits, n).get(key) for key in ("kernel", "dequant", "x"))
             for name, (n, k, gated) in shapes.items() for bits in (8, 4)}
    assert forms == {
        ("qkv", 8): ("rows", "bits", None), ("qkv", 4): ("rows", "bits", "split"),
        ("o", 8): ("rows", "bits", None), ("o", 4): ("rows", "bits", "split"),
        ("gate|up", 8): ("tiles", "bits", None), ("gate|up", 4): ("rows", "bits", "split"),
        ("down", 8): ("rows", "bits", None), ("down", 4): ("rows", "bits", "split"),
        ("lm_head", 8): ("tiles", "bits", None), ("lm_head", 4): ("tiles", "bits", "split"),
    }
    # the 8B shapes (K = 4096, not measured) keep the rows kernel for the gated and lm_head projections
    assert _config(4096, True, 4, 28672)["kernel"] == _config(4096, False, 4, 128256)["kernel"] == "rows"
    assert _config(4096, True, 8, 28672)["kernel"] == _config(4096, False, 8, 128256)["kernel"] == "rows"
    assert "dequant" not in _config(2048, True, 0, 16384)  # float weights: unchanged


@needs_triton
@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 32)])
def test_decode_gemv_takes_every_quantized_linear(scheme, group):
    """The example's decode method, quantized: every linear (the 256-row output projection too)
    becomes one GEMV over the stored form, with the same folds as the float program; no
    dequantize node and no float linear weight is left."""
    from offgraph_export.frontends import load_bundle
    from offgraph_export.passes.decode_gemv import GemvCounts, decode_gemv
    from offgraph_export.passes.specialize_width import specialize_width
    from offgraph_export.pipeline import export_model, run_passes
    from tests.conftest import EXAMPLE

    bundle = load_bundle(EXAMPLE)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "portable", quantize=scheme, group_size=group)
    fixed = specialize_width(program.pass_results["strip_kv_cache"].program, program.step_width).program
    result = decode_gemv(fixed, device_types=("cpu",))
    assert result.produced == GemvCounts(linears=9, norms=5, gated=2, residuals=4, quantized=9)
    gemv = torch.ops.offgraph_lowered.triton_gemv.default
    nodes = [n for n in fixed.graph.nodes if n.target is gemv]
    assert len(nodes) == 9 and all(n.args[7] is not None for n in nodes)  # scales given
    assert not any(n.target is torch.ops.offgraph.dequantize_weight.default for n in fixed.graph.nodes)
    assert not any(n.target is torch.ops.aten.linear.default for n in fixed.graph.nodes)
    fixed.validate()


@interpreter_only
@pytest.mark.parametrize("scheme,group", [(None, None), ("int4", 32)])
def test_interp_final_norm_folds_through_the_lm_head_slice(tmp_path, scheme, group):
    """transformers' Llama slices the final norm's output (``hidden_states[:, -0:]``) before its
    lm_head: the decode method's lm_head GEMV takes that norm too (no rsqrt left), and the
    rewritten method computes the logits the method before the rewrite computes (fp32, the
    interpreter running the kernels), from the same inputs and storage."""
    import copy

    transformers = pytest.importorskip("transformers")
    from offgraph_export.frontends import load_bundle
    from offgraph_export.passes.decode_gemv import decode_gemv
    from offgraph_export.passes.specialize_width import specialize_width
    from offgraph_export.pipeline import export_model, run_passes
    from tests.test_frontend_hf import COMMON

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path / "llama")
    bundle = load_bundle(f"hf:{tmp_path / 'llama'}", initial_capacity=16)
    inputs = bundle.example_inputs
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "portable", quantize=scheme or "none", group_size=group)
    plain = specialize_width(program.pass_results["strip_kv_cache"].program, program.step_width).program
    # the pattern this pins: the final norm, a whole-tensor slice, then the lm_head
    head = [n for n in plain.graph.nodes if n.target is torch.ops.aten.linear.default][-1]
    assert head.args[0].target is torch.ops.aten.slice.Tensor
    folded = copy.deepcopy(plain)
    result = decode_gemv(folded, device_types=("cpu",))
    layers = COMMON["num_hidden_layers"]
    assert result.produced.linears == 4 * layers + 1 and result.produced.norms == 2 * layers + 1
    assert not any(n.target is torch.ops.aten.rsqrt.default for n in folded.graph.nodes)
    folded.validate()
    args, _ = plain.example_inputs
    gen = torch.Generator().manual_seed(1)
    args = [a.clone().normal_(generator=gen) if a.is_floating_point() else a.clone() for a in args]
    args[1] = torch.full_like(args[1], args[2].shape[2] - 3)  # a position with history before it
    a, b = [x.clone() for x in args], [x.clone() for x in args]
    got, want = folded.module()(*a), plain.module()(*b)
    got, want = (o[0] if isinstance(o, (tuple, list)) else o for o in (got, want))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@needs_triton
def test_a_slice_that_keeps_part_of_the_norm_does_not_fold_it():
    """Two rows normed, the last one sliced off for a one-row linear: the norm's output is not the
    linear's whole input, so the GEMV takes the linear without the norm (which stays)."""
    from offgraph_export.passes.decode_gemv import decode_gemv

    class LastRowHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Parameter(torch.rand(64))
            self.w = torch.nn.Parameter(torch.randn(48, 64))

        def forward(self, x):
            xf = x.float()
            normed = self.norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            return torch.nn.functional.linear(normed[:, -1:, :], self.w)

    ep = torch.export.export(LastRowHead(), (torch.randn(1, 2, 64),))
    assert any(n.target is torch.ops.aten.slice.Tensor for n in ep.graph.nodes)
    result = decode_gemv(ep, device_types=("cpu",))
    assert result.produced.linears == 1 and result.produced.norms == 0
    assert any(n.target is torch.ops.aten.rsqrt.default for n in ep.graph.nodes)


@needs_triton
def test_decode_gemv_takes_biased_projections(tmp_path):
    """A transformers Qwen2 (q/k/v with biases, fused into one biased q|k|v): every linear of its
    decode method becomes a GEMV, the biased ones with their bias."""
    transformers = pytest.importorskip("transformers")
    from offgraph_export.frontends import load_bundle
    from offgraph_export.passes.decode_gemv import decode_gemv
    from offgraph_export.passes.specialize_width import specialize_width
    from offgraph_export.pipeline import export_model, run_passes
    from tests.test_frontend_hf import COMMON

    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)).save_pretrained(tmp_path / "qwen2")
    bundle = load_bundle(f"hf:{tmp_path / 'qwen2'}")
    inputs = bundle.example_inputs
    ep = export_model(bundle.model.requires_grad_(False), inputs, bundle.token_dims, bundle.cache_config.max_write)
    program = run_passes(ep, inputs, bundle.cache_config, "portable")
    fixed = specialize_width(program.pass_results["strip_kv_cache"].program, program.step_width).program
    result = decode_gemv(fixed, device_types=("cpu",))
    gemv = torch.ops.offgraph_lowered.triton_gemv.default
    nodes = [n for n in fixed.graph.nodes if n.target is gemv]
    layers = COMMON["num_hidden_layers"]
    assert result.produced.linears == len(nodes) == 4 * layers + 1  # q|k|v, o, gate|up, down; lm_head
    assert sum(n.args[10] is not None for n in nodes) == layers  # the biased q|k|v
    assert not any(n.target is torch.ops.aten.linear.default for n in fixed.graph.nodes)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("n, k, gated", [(4608, 3584, False), (37888, 3584, True), (6144, 4096, False)])
def test_gemv_at_the_7b_8b_shapes_on_cuda(n, k, gated):
    """bf16 at Qwen2.5-7B's biased q|k|v and gated gate|up and Llama-3.1-8B's q|k|v (issue 27's
    shapes), with a bias: as close to a float64 recompute as eager bf16."""
    from offgraph_export.kernels.triton_gemv import gemv_applies, triton_gemv

    assert gemv_applies((1, 1, k), (n, k), gated=gated)
    x, w, nw, _ = _fold_inputs(n, k, torch.bfloat16, True, gated, False, device="cuda", seed=3)
    bias = (0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16)
    want = _eager_folds(x.double(), w.double(), nw.double(), 1e-5, None, gated, True, bias=bias.double())
    eager = _eager_folds(x, w, nw, 1e-5, None, gated, True, bias=bias)
    got = triton_gemv(x, w, nw, 1e-5, None, gated, True, bias=bias)
    _assert_as_close_as_eager(got, want, eager)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("trigger", ["entry", "exit"])
@pytest.mark.parametrize("edges", [False, True], ids=["pdl_launches", "edges_after_capture"])
@pytest.mark.parametrize("scheme,group", [("bf16", None), *SCHEMES])
def test_pdl_chain_in_a_cuda_graph_equals_plain_launches(scheme, group, edges, trigger):
    """A chain whose every GEMV reads the one before's output (o + residual, gate|up + norm +
    SiLU*mul, down + residual, four layers), its kernels compiled to wait on entry
    (``kernels/triton_base.wait_for_inputs``) and captured in a CUDA graph whose edges between them
    are programmatic: launched as programmatic dependent launches (``"pdl": True``), or launched
    plainly (``"code"``) and the edges made programmatic after the capture
    (``runtime/graph_edges.make_programmatic``). The graph holds the programmatic edges, and each
    replay on a fresh input is bit-equal to the chain launched plainly on that input: a kernel that
    started before its input was written would read the last replay's values. Both triggers: the
    dependents let in at a kernel's entry or as its programs exit."""
    from offgraph_export.kernels.triton_gemv import _config, gemv_launch
    from offgraph_export.runtime.graph_edges import PROGRAMMATIC, edge_types, make_programmatic

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    gen = torch.Generator().manual_seed(3)

    def weight(n, k):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        if scheme == "bf16":
            return {"w": w.cuda()}
        stored, _ = _quantized(w, scheme, group)
        return {"w": stored.qweight.cuda(), "scales": stored.scales.cuda(),
                "zeros": None if stored.zeros is None else stored.zeros.cuda(), "group_size": group or 0}

    layers = [(weight(2048, 2048), weight(2 * 8192, 2048), weight(2048, 8192)) for _ in range(4)]
    norm = (1 + 0.1 * torch.randn(2048, generator=gen)).to(torch.bfloat16).cuda()
    h0 = torch.empty(2048, dtype=torch.bfloat16, device="cuda")  # the graph's input, refilled before each replay

    def launch(x, p, pdl, **folds):
        quant = 0 if "scales" not in p else (4 if p["zeros"] is not None else 8)
        config = _config(x.shape[-1], folds.get("gated", False), quant, int(p["w"].shape[0]), False) | {"pdl": pdl, "pdl_trigger": trigger}
        return gemv_launch(x, p["w"], folds.get("norm"), 1e-5, folds.get("residual"), folds.get("gated", False), True,
                           config, scales=p.get("scales"), zeros=p.get("zeros"), group_size=p.get("group_size", 0))

    def chain(pdl):
        h = h0
        for o, gate_up, down in layers:
            h = launch(h, o, pdl, residual=h)
            h = launch(launch(h, gate_up, pdl, norm=norm, gated=True), down, pdl, residual=h)
        return h

    pdl = "code" if edges else True
    h0.copy_(torch.randn(2048, generator=gen).to(torch.bfloat16))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(pdl)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        got = chain(pdl)
    if edges:
        assert make_programmatic(graph.raw_cuda_graph(), lambda name: name.startswith("_gemv")) == 11
    assert edge_types(graph.raw_cuda_graph())[PROGRAMMATIC] >= 11  # 12 kernels, each after the one before
    graph.instantiate()
    for _ in range(3):
        h0.copy_(torch.randn(2048, generator=gen).to(torch.bfloat16))
        want = chain(False)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_a_launch_names_its_pdl_form():
    """A launch's ``"pdl"`` is True, ``"code"`` or False and its ``"pdl_trigger"`` "entry" or
    "exit": another value is refused by name before anything runs."""
    from offgraph_export.kernels.triton_gemv import _config, gemv_launch

    x, w = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'yes'"):
        gemv_launch(x, w, config=_config(64) | {"pdl": "yes"})
    with pytest.raises(ValueError, match="'late'"):
        gemv_launch(x, w, config=_config(64) | {"pdl": False, "pdl_trigger": "late"})


@interpreter_only
def test_interp_refuses_a_pdl_launch():
    """The interpreter has no griddepcontrol: a PDL launch there is refused by name, not run."""
    from offgraph_export.kernels.triton_gemv import _config, gemv_launch

    x, w = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter"):
        gemv_launch(x, w, config=_config(64) | {"pdl": "code"})
