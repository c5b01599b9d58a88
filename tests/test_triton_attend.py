"""The Triton lowered step against the portable one (its reference semantics).

Three groups:

* ``test_interp_*``: the kernels run in the Triton interpreter on CPU tensors. The interpreter is
  chosen when ``triton.jit`` decorates a kernel, i.e. from ``TRITON_INTERPRET`` at import time, and
  setting it in this process would also turn the GPU tests below into interpreter runs. So
  ``test_interpreter_suite`` runs them in a child pytest with ``TRITON_INTERPRET=1``; in the parent
  process they skip. Run them directly with ``TRITON_INTERPRET=1 pytest tests/test_triton_attend.py
  -k test_interp_``.
* CPU tests that need triton importable but run no kernel (export tracing, error messages).
* ``cuda``: the same cases on a GPU, and ``torch.export`` + AOTInductor packaging of the op.
"""

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
import pytest
import torch

from offgraph_export.errors import ExportError
from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.specs.manifest import storage_row
from tests.triton_testing import (
    HAVE_TRITON, INTERPRETING, REPO_ROOT, interpreter_only, needs_cuda, needs_triton, run_interpreter_cases,
)

if HAVE_TRITON:
    from offgraph_export.kernels import attend_prefill
    from offgraph_export.kernels.triton_attend import triton_update_and_attend


# ---------------------------------------------------------------------------------------------
# Cases and the comparison harness (shared by the interpreter and GPU tests)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A layer layout and a session: ``history`` positions already written (filled directly,
    like an earlier session), then steps of the given token widths."""

    id: str
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dv: int = 16
    rows: int = 64
    window: int | None = None
    history: int = 0
    steps: tuple[int, ...] = (5,)
    batch: int = 1
    store_dtype: torch.dtype = torch.float32
    q_dtype: torch.dtype | None = None  # None: the storage dtype
    out_dtype: torch.dtype | None = None  # None: the q dtype
    position_2d: bool = False  # position as [T, 1]
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False)


def _tolerance(*dtypes: torch.dtype) -> dict[str, float]:
    if torch.bfloat16 in dtypes:
        return dict(atol=2e-2, rtol=2e-2)
    if torch.float16 in dtypes:
        return dict(atol=5e-3, rtol=5e-3)
    return dict(atol=2e-5, rtol=2e-5)


def _poisoned_storage(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN everywhere, then the rows that hold the ``history`` positions."""
    shape_k = (case.batch, case.hkv, case.rows, case.d)
    shape_v = (case.batch, case.hkv, case.rows, case.dv)
    k_store = torch.full(shape_k, float("nan"), dtype=case.store_dtype, device=device)
    v_store = torch.full(shape_v, float("nan"), dtype=case.store_dtype, device=device)
    gen = torch.Generator().manual_seed(case.seed + 1000)
    first = 0 if case.window is None else max(0, case.history - case.rows)
    held = torch.arange(first, case.history)
    rows = held if case.window is None else held % case.rows
    n = len(held)
    k_store[:, :, rows.to(device)] = torch.randn(*shape_k[:2], n, case.d, generator=gen).to(k_store)
    v_store[:, :, rows.to(device)] = torch.randn(*shape_v[:2], n, case.dv, generator=gen).to(v_store)
    return k_store, v_store


def _step_inputs(case: Case, start: int, t: int, gen: torch.Generator, device: str):
    """q, k, v as a model makes them: ``[B, T, H, D]`` projections transposed to BHSD (so they
    are non-contiguous views)."""
    dtype = case.q_dtype or case.store_dtype
    def bhsd(heads: int, dim: int) -> torch.Tensor:
        x = torch.randn(case.batch, t, heads, dim, generator=gen)
        return x.to(device, dtype).transpose(1, 2)

    q, k, v = bhsd(case.hq, case.d), bhsd(case.hkv, case.d), bhsd(case.hkv, case.dv)
    position = torch.arange(start, start + t, dtype=torch.int64, device=device)
    if case.position_2d:
        position = position[:, None]
    return q, k, v, position


def _never_written_rows(case: Case, end: int) -> list[int]:
    """Rows no position below ``end`` maps to: they must still be NaN."""
    written = {p if case.window is None else p % case.rows for p in range(end)}
    return [r for r in range(case.rows) if r not in written]


def run_session(case: Case, device: str) -> None:
    """Run every step through both implementations, each on its own storage, and compare the
    outputs (dtype tolerance), the storage (bit for bit, NaN where NaN) and the poisoned rows."""
    k_tri, v_tri = _poisoned_storage(case, device)
    k_ref, v_ref = k_tri.clone(), v_tri.clone()
    gen = torch.Generator().manual_seed(case.seed)
    scale = case.d**-0.5
    q_dtype = case.q_dtype or case.store_dtype
    out_dtype = case.out_dtype or q_dtype
    tol = _tolerance(case.store_dtype, q_dtype, out_dtype)
    # Written rows are bit-exact casts; except that the Triton *interpreter* truncates fp32 ->
    # bf16 instead of rounding to nearest even (GPUs round like torch), so allow one bf16 ulp there.
    store_tol = dict(atol=0.0, rtol=0.0)
    if INTERPRETING and case.store_dtype == torch.bfloat16 and q_dtype != torch.bfloat16:
        store_tol = dict(atol=0.0, rtol=2**-7)
    start = case.history
    for step, t in enumerate(case.steps):
        q, k, v, position = _step_inputs(case, start, t, gen, device)
        out = triton_update_and_attend(
            q, k, v, position, k_tri, v_tri, case.window, scale, out_dtype
        )
        ref = portable_update_and_attend(
            q, k, v, position, k_ref, v_ref, case.window, scale, out_dtype
        )
        where = f"{case.id} step {step} (positions {start}..{start + t - 1})"
        assert out.shape == ref.shape and out.dtype == out_dtype, where
        # token-major (attend_common.attention_output): the model's transpose before o_proj is a view
        assert out.transpose(1, 2).is_contiguous(), f"{where}: output strides {out.stride()}"
        assert torch.isfinite(out.float()).all(), f"{where}: non-finite output (NaN leaked?)"
        torch.testing.assert_close(out.float(), ref.float(), msg=lambda m: f"{where}: {m}", **tol)
        torch.testing.assert_close(k_tri, k_ref, equal_nan=True, **store_tol)
        torch.testing.assert_close(v_tri, v_ref, equal_nan=True, **store_tol)
        start += t
        untouched = _never_written_rows(case, start)
        assert k_tri[:, :, untouched].isnan().all() and v_tri[:, :, untouched].isnan().all(), where


# Small shapes so the interpreter stays fast. With the interpreter's split settings below
# (_SMALL_SPLITS), a history of a few hundred keys already uses several splits.
CASES = [
    Case("flat_prefill_tiled_mid_history", rows=48, history=9, steps=(12,)),
    Case("flat_short_step_split_variant", rows=48, history=9, steps=(3,)),
    Case("flat_from_empty", rows=32, steps=(4, 1, 1)),
    Case("ring_wrap_past_window", window=8, rows=11, steps=(4, 4, 3, 1, 1, 1, 4, 2, 1)),
    Case("ring_prefill_tiled_wraps", window=8, rows=17, history=5, steps=(10, 10, 1)),
    Case("gqa_4_2_decode_long_history", rows=400, history=330, steps=(1, 1)),
    Case("mqa_8_1_dv_ne_d_decode", hq=8, hkv=1, d=32, dv=16, rows=400, history=300, steps=(1,)),
    Case("mqa_8_1_prefill", hq=8, hkv=1, d=16, dv=32, rows=80, history=20, steps=(17,)),
    Case("ring_decode_split", window=300, rows=303, history=700, steps=(1, 3)),
    Case("batch2_position_2d", batch=2, rows=40, history=6, steps=(5, 1), position_2d=True),
    Case("head_dim_not_pow2", d=24, dv=40, rows=40, history=3, steps=(6, 1)),
    Case("bf16_storage", store_dtype=torch.bfloat16, rows=300, history=200, steps=(9, 1)),
    Case("fp16_storage", store_dtype=torch.float16, rows=300, history=200, steps=(9, 1)),
    Case(
        "fp32_q_into_bf16_storage",
        store_dtype=torch.bfloat16, q_dtype=torch.float32, rows=40, history=7, steps=(4, 1),
    ),
    Case(
        "bf16_q_fp32_out_ring",
        store_dtype=torch.bfloat16, out_dtype=torch.float32, window=6, rows=9, steps=(4, 4, 1),
    ),
]

# Split-K settings small enough that short interpreter histories still split several ways, each
# where it is defined (and alone read).
_SMALL_SPLITS = {
    "offgraph_export.kernels.attend_common._MAX_SPLITS": 4,
    "offgraph_export.kernels.attend_prefill._SPLIT_TARGET_PROGRAMS": 8,
    "offgraph_export.kernels.attend_prefill._MIN_SPLIT_KEYS": 64,
    "offgraph_export.kernels.attend_decode._DECODE_MIN_SPLIT_KEYS": 64,
}


def _use_small_splits(monkeypatch) -> None:
    for target, value in _SMALL_SPLITS.items():
        monkeypatch.setattr(target, value)


# ---------------------------------------------------------------------------------------------
# Interpreter (CPU) tests
# ---------------------------------------------------------------------------------------------


@needs_triton
def test_interpreter_suite():
    """Run the ``test_interp_*`` cases in a child process with ``TRITON_INTERPRET=1``."""
    run_interpreter_cases(__file__)


@interpreter_only
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_interp_matches_portable(case, monkeypatch):
    _use_small_splits(monkeypatch)
    run_session(case, "cpu")


@interpreter_only
def test_interp_default_split_settings_long_decode():
    """The production split settings (64 splits, >= 256 keys each) over a 700-key history."""
    run_session(Case("default_splits", rows=720, history=700, steps=(1,)), "cpu")


@interpreter_only
@pytest.mark.parametrize(
    "module, kernel, width, part_m_arg",
    [("attend_decode", "_decode_attend_kernel", 1, 8), ("attend_prefill", "_attend_kernel", 2, 6)],
    ids=["one_token_kernel", "split_variant"],
)
def test_interp_short_step_really_splits(monkeypatch, module, kernel, width, part_m_arg):
    """A short step over a long history splits its keys several ways: the partial rows of
    exactly the splits the plan says get written (the buffers are NaN-filled first), and the
    combine kernel merges them into the output compared above. One token takes its own kernel
    (row write folded in); two take the multi-token split variant."""
    _use_small_splits(monkeypatch)
    owner = importlib.import_module(f"offgraph_export.kernels.{module}")
    real = getattr(owner, kernel)
    partial_maxima = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs.get("SPLIT", True) and grid[0] > 0:
                    args[part_m_arg].fill_(float("nan"))
                    real[grid](*args, **kwargs)
                    partial_maxima.append(args[part_m_arg].clone())
                else:
                    real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(owner, kernel, Spy())
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: kernel)
    # 330 or 331 keys, at most 4 splits of >= 64 keys in 64-key blocks: 3 chunks of 128.
    run_session(Case("spy", hq=4, hkv=2, rows=400, history=330, steps=(width,)), "cpu")
    (part_m,) = partial_maxima  # [B * Hkv, splits, tile rows]
    rows = 2 * width  # query rows: tokens x heads of the group
    assert torch.isfinite(part_m[:, :3, :rows]).all(), part_m[:, :, :rows]
    assert part_m[:, 3:].isnan().all() and part_m[:, :, rows:].isnan().all()


@interpreter_only
def test_interp_position_beyond_flat_capacity_is_not_written():
    """A flat write past the last row is dropped instead of corrupting memory."""
    case = Case("overflow", rows=8)
    k_store, v_store = _poisoned_storage(case, "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v, position = _step_inputs(case, 8, 1, gen, "cpu")
    triton_update_and_attend(q, k, v, position, k_store, v_store, None, 0.25, torch.float32)
    assert k_store.isnan().all() and v_store.isnan().all()


# ---------------------------------------------------------------------------------------------
# CPU tests without kernels
# ---------------------------------------------------------------------------------------------


class _TwoLayerStep(torch.nn.Module):
    """A flat and a ring layer sharing q/k/v, fed BTHD projections like a model."""

    def __init__(self, window: int, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.window = window
        self.out_dtype = out_dtype

    def forward(self, q, k, v, position, k_flat, v_flat, k_ring, v_ring):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scale = q.shape[-1] ** -0.5
        flat = triton_update_and_attend(
            q, k, v, position, k_flat, v_flat, None, scale, self.out_dtype
        )
        ring = triton_update_and_attend(
            q, k, v, position, k_ring, v_ring, self.window, scale, self.out_dtype
        )
        return flat, ring


def _two_layer_inputs(t, rows_flat, rows_ring, device, dtype, b=1, hq=4, hkv=2, d=64):
    return (
        torch.randn(b, t, hq, d, device=device, dtype=dtype),
        torch.randn(b, t, hkv, d, device=device, dtype=dtype),
        torch.randn(b, t, hkv, d, device=device, dtype=dtype),
        torch.arange(t, dtype=torch.int64, device=device),
        torch.zeros(b, hkv, rows_flat, d, device=device, dtype=dtype),
        torch.zeros(b, hkv, rows_flat, d, device=device, dtype=dtype),
        torch.zeros(b, hkv, rows_ring, d, device=device, dtype=dtype),
        torch.zeros(b, hkv, rows_ring, d, device=device, dtype=dtype),
    )


def _export_two_layers(device: str, dtype: torch.dtype, window: int = 16, rows_ring: int = 23):
    from torch.export import Dim

    args = _two_layer_inputs(5, 48, rows_ring, device, dtype)
    t, rows = Dim.DYNAMIC, Dim.DYNAMIC
    shapes = ({1: t}, {1: t}, {1: t}, {0: t}, {2: rows}, {2: rows}, {}, {})
    ep = torch.export.export(
        _TwoLayerStep(window, dtype), args, dynamic_shapes=shapes, strict=False
    )
    return ep


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="export traces the kernels, not the interpreter")
def test_export_keeps_one_node_per_layer_with_dynamic_width_and_rows():
    """The host code runs on SymInts (T and the flat rows stay dynamic), and export records the
    op, not its kernels: one node per layer."""
    ep = _export_two_layers("cpu", torch.float32)
    targets = [
        n.target for n in ep.graph.nodes
        if n.op == "call_function" and "triton_update_and_attend" in str(n.target)
    ]
    assert len(targets) == 2, ep.graph
    names = list(ep.graph_signature.user_inputs)
    assert names == ["q", "k", "v", "position", "k_flat", "v_flat", "k_ring", "v_ring"], names
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    flat_rows = placeholders["k_flat"].meta["val"].shape[2]
    assert isinstance(flat_rows, torch.SymInt), "flat rows were specialized"
    assert isinstance(placeholders["q"].meta["val"].shape[1], torch.SymInt), "T was specialized"


@needs_triton
def test_split_variant_gate():
    """The split variant serves exactly the steps whose query rows fit its tile, and always
    T = 1 and 2 (export's dynamic widths start at 2, so the gate must not be foldable to 0)."""
    for group in (1, 2, 4, 8, 16, 32):
        small_t = attend_prefill._small_t(group)
        assert small_t >= 2 and group * small_t <= attend_prefill._split_block_m(group)
        gates = [attend_prefill._is_small_step(t, small_t) for t in range(1, 4 * small_t + 1)]
        assert gates == [1] * small_t + [0] * (3 * small_t), group
        assert attend_prefill._is_small_step(100_000, small_t) == 0


def test_window_must_be_positive():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    q = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ExportError, match="window"):
        triton_update_and_attend(q, q, q, torch.zeros(1, dtype=torch.int64), q, q, 0, 1.0,
                                 torch.float32)


def test_missing_triton_raises_export_error_only_when_used():
    """Without triton the module imports; calling the step raises ExportError naming triton."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from offgraph_export.errors import ExportError\n"
        "from offgraph_export.kernels import triton_attend as m\n"
        "x = torch.zeros(1, 1, 1, 16)\n"
        "try:\n"
        "    m.triton_update_and_attend(x, x, x, torch.zeros(1, dtype=torch.int64), x, x, None,"
        " 1.0, torch.float32)\n"
        "except ExportError as e:\n"
        "    assert 'triton' in str(e), e\n"
        "    print('OK')\n"
    )
    env = {**os.environ}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------

GPU_CASES = CASES + [
    Case("gpu_llama1b_decode_bf16", hq=32, hkv=8, d=64, dv=64, rows=4096, history=3000,
         steps=(1, 1), store_dtype=torch.bfloat16),
    Case("gpu_llama1b_prefill_bf16", hq=32, hkv=8, d=64, dv=64, rows=4096, history=1000,
         steps=(300, 2), store_dtype=torch.bfloat16),
    Case("gpu_hd128_decode_bf16", hq=8, hkv=2, d=128, dv=128, rows=9000, history=8191,
         steps=(1,), store_dtype=torch.bfloat16),
    Case("gpu_hd128_prefill_fp16", hq=16, hkv=4, d=128, dv=128, rows=2048, history=700,
         steps=(129,), store_dtype=torch.float16),
    Case("gpu_hd128_ring_window_decode", hq=8, hkv=2, d=128, dv=128, window=4096, rows=4096 + 63,
         history=10000, steps=(64, 1, 1), store_dtype=torch.bfloat16),
    Case("gpu_fp32_long_decode", hq=8, hkv=2, d=64, dv=64, rows=5000, history=4500, steps=(1,)),
    Case("gpu_mqa_group32_decode", hq=32, hkv=1, d=64, dv=64, rows=3000, history=2500,
         steps=(1, 2), store_dtype=torch.bfloat16),
    Case("gpu_batch4_decode", batch=4, hq=8, hkv=2, d=64, dv=64, rows=2048, history=1500,
         steps=(1,), store_dtype=torch.bfloat16),
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_cuda_matches_portable(case):
    run_session(case, "cuda")
    torch.cuda.synchronize()


def _compile_two_layers(args, kernels):
    from torch._inductor.utils import run_and_get_code

    for x in args[:3]:
        torch._dynamo.maybe_mark_dynamic(x, 1)  # T
    torch._dynamo.maybe_mark_dynamic(args[3], 0)
    torch._dynamo.maybe_mark_dynamic(args[4], 2)  # flat rows
    torch._dynamo.maybe_mark_dynamic(args[5], 2)
    compiled = torch.compile(_TwoLayerStep(16, torch.bfloat16), fullgraph=True)
    _, codes = run_and_get_code(compiled, *args)
    # the code, without the comments that name the FX nodes each kernel came from (functional
    # clones Inductor re-inplaced are named there)
    code = "\n".join(line for c in codes for line in c.splitlines() if not line.lstrip().startswith("#"))
    assert all(k in code for k in kernels), code[-4000:]
    for word in ("clone(", "clone.default", ".copy_("):  # calls, not the kernels' docstrings
        assert word not in code, f"compiled step contains {word!r}:\n{code[-6000:]}"
    return compiled, code


@pytest.mark.cuda
@needs_cuda
def test_cuda_compiled_step_adds_no_copies():
    """Compiled (Inductor, dynamic shapes), a step must never copy the storage: a clone of it (a
    functionalization copy Inductor failed to re-inplace) would turn every step into a whole-cache
    copy. A multi-token step copies q/k/v on purpose (``dense_copy``: token-sized, so the kernels'
    stride arguments hold in any trace); its peak memory over a 16 MiB flat cache stays far below
    the cache's size. A one-token step launches no pointwise kernel at all (no copy of anything)."""
    rows = 1 << 16
    args = _two_layer_inputs(5, rows, 23, "cuda", torch.bfloat16)
    cache_bytes = args[4].numel() * args[4].element_size()
    assert cache_bytes == 16 << 20
    compiled, _ = _compile_two_layers(args, ["_write_rows_kernel", "_attend_kernel"])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outs = compiled(*args)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < cache_bytes // 8, f"a step over a {cache_bytes}-byte cache allocated {extra} bytes"
    assert all(torch.isfinite(o.float()).all() for o in outs)

    torch._dynamo.reset()
    one = _two_layer_inputs(1, rows, 23, "cuda", torch.bfloat16)
    _, code = _compile_two_layers(one, ["_decode_attend_kernel"])  # the row write folded in
    assert "triton_poi" not in code, f"the one-token step launches a pointwise kernel:\n{code[-6000:]}"


_LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
_AOTI_CHILD = "OFFGRAPH_TRITON_AOTI_CHILD"


@pytest.mark.cuda
@pytest.mark.slow
@needs_cuda
def test_cuda_aoti_package_matches_portable(tmp_path):
    """torch.export + AOTInductor: the package writes the storage in place and matches the
    portable step over a session (prefill, short steps, decode over a longer flat history that
    takes the split path; the ring wraps). Dynamic T and flat rows: the package is compiled with
    example T=5, rows=48 and run with other widths and a larger flat storage.

    Loading a package on the GPU machine needs libstdc++ preloaded (DEVICE.md), so unless it is,
    the test re-runs itself in a child process that has it."""
    preload = os.environ.get("LD_PRELOAD", "")
    if os.path.exists(_LIBSTDCXX) and _LIBSTDCXX not in preload and not os.environ.get(_AOTI_CHILD):
        env = {**os.environ, "LD_PRELOAD": ":".join(filter(None, [_LIBSTDCXX, preload])),
               _AOTI_CHILD: "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-m", "pytest",
             f"{__file__}::{test_cuda_aoti_package_matches_portable.__name__}",
             "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "child")],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800,
        )
        report = proc.stdout[-8000:] + proc.stderr[-4000:]
        assert proc.returncode == 0 and " passed" in proc.stdout, report
        return

    dtype = torch.bfloat16
    window, rows_ring = 16, 16 + 64 - 1  # ring rows = window + max_write - 1 (widest step: 64)
    ep = _export_two_layers("cuda", dtype, window, rows_ring)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "step.pt2"))
    runner = torch._inductor.aoti_load_package(path)

    b, hq, hkv, d, rows_flat = 1, 4, 2, 64, 2048
    nan = float("nan")
    k_flat = torch.full((b, hkv, rows_flat, d), nan, dtype=dtype, device="cuda")
    v_flat, k_ring, v_ring = (
        k_flat.clone(),
        torch.full((b, hkv, rows_ring, d), nan, dtype=dtype, device="cuda"),
        torch.full((b, hkv, rows_ring, d), nan, dtype=dtype, device="cuda"),
    )
    ref = [x.clone() for x in (k_flat, v_flat, k_ring, v_ring)]
    gen = torch.Generator().manual_seed(0)
    scale = d**-0.5
    tol = _tolerance(dtype)
    start = 0
    widths = (20, 3, 1, 8, *([64] * 15), 40, 1, 1, 2)  # ends past 1000 positions
    for step, t in enumerate(widths):
        q = torch.randn(b, t, hq, d, generator=gen).to("cuda", dtype)
        k = torch.randn(b, t, hkv, d, generator=gen).to("cuda", dtype)
        v = torch.randn(b, t, hkv, d, generator=gen).to("cuda", dtype)
        position = torch.arange(start, start + t, dtype=torch.int64, device="cuda")
        flat, ring = runner(q, k, v, position, k_flat, v_flat, k_ring, v_ring)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        flat_ref = portable_update_and_attend(
            qt, kt, vt, position, ref[0], ref[1], None, scale, dtype
        )
        ring_ref = portable_update_and_attend(
            qt, kt, vt, position, ref[2], ref[3], window, scale, dtype
        )
        torch.cuda.synchronize()
        where = f"step {step} (T={t}, positions {start}..{start + t - 1})"
        for got, want, name in ((flat, flat_ref, "flat"), (ring, ring_ref, "ring")):
            assert torch.isfinite(got.float()).all(), f"{where}: {name} output not finite"
            torch.testing.assert_close(
                got.float(), want.float(), msg=lambda m: f"{where} {name}: {m}", **tol
            )
        for got, want in zip((k_flat, v_flat, k_ring, v_ring), ref):
            torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
        start += t
        assert k_flat[:, :, start:].isnan().all() and v_flat[:, :, start:].isnan().all(), where


# ---------------------------------------------------------------------------------------------
# The one-row GEMV of the decode method's projections (kernels/triton_gemv.py)
# ---------------------------------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize(
    "n, k, dtype",
    [(37, 300, torch.float32), (64, 1100, torch.bfloat16), (1, 512, torch.float32), (2048, 96, torch.float16)],
)
def test_interp_gemv_matches_linear(n, k, dtype):
    """Odd sizes (partial row and column blocks), one row and many, 16-bit and fp32 weights;
    against ``F.linear`` computed in fp32 and rounded like the kernel's output."""
    from offgraph_export.kernels.triton_gemv import triton_gemv

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, 1, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    got = triton_gemv(x, w)
    want = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **_tolerance(dtype))


@interpreter_only
def test_interp_gemv_reads_a_strided_row():
    """A row that is a strided view (every other element) gives the same result as its copy."""
    from offgraph_export.kernels.triton_gemv import triton_gemv

    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(1, 1, 2 * 200, generator=gen)
    w = torch.randn(48, 200, generator=gen)
    x = wide[..., ::2]
    assert x.stride(-1) == 2
    torch.testing.assert_close(triton_gemv(x, w), torch.nn.functional.linear(x, w), atol=2e-5, rtol=2e-5)


def test_gemv_applies_only_to_narrow_one_row_linears():
    from offgraph_export.kernels.triton_gemv import MAX_GATED_ROWS, MAX_GEMV_ROWS, gemv_applies

    assert gemv_applies((1, 1, 2048), (3072, 2048))
    assert not gemv_applies((1, 2, 2048), (3072, 2048))  # two rows
    assert not gemv_applies((1, 1, 2048), (MAX_GEMV_ROWS + 1, 2048))  # wide: the compiler's GEMM
    assert not gemv_applies((1, 1, 2048), (3072, 1024))  # mismatched K
    # a gated gate|up up to MAX_GATED_ROWS outputs: the Llama-3.1-8B shape's 2 x 14336 rows
    assert gemv_applies((1, 1, 4096), (2 * 14336, 4096), gated=True) and not gemv_applies((1, 1, 4096), (28672, 4096))
    assert not gemv_applies((1, 1, 4096), (2 * (MAX_GATED_ROWS + 1), 4096), gated=True)
    # a quantized weight at any width (the lm_head): the compiler has no GEMM that reads its stored form
    assert gemv_applies((1, 1, 2048), (128256, 2048), quantized=True)


# The GEMV's folds: RMSNorm prologue, gated (silu(gate) * up) and residual epilogues.


def _eager_folds(x, w, norm_weight=None, eps=1e-5, residual=None, gated=False, gate_first=True, bias=None):
    """What the folded nodes compute in eager PyTorch (Llama's RMSNorm, SiLU·mul, residual add)."""
    dt = w.dtype
    if norm_weight is not None:
        xf = x.float()
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    y = torch.nn.functional.linear(x, w, bias)
    if gated:
        gate, up = y.split(w.shape[0] // 2, -1)
        if not gate_first:
            gate, up = up, gate
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y


def _fold_inputs(n, k, dtype, norm, gated, residual, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed + n + k)
    x = torch.randn(1, 1, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype) if norm else None
    res = torch.randn(1, 1, n // 2 if gated else n, generator=gen).to(device, dtype) if residual else None
    return x, w, nw, res


FOLDS = [  # (norm, gated, gate_first, residual)
    (True, False, True, False), (False, False, True, True), (True, True, True, False),
    (True, True, False, True), (False, True, False, False), (True, False, True, True),
]


@interpreter_only
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS)
@pytest.mark.parametrize("n, k", [(40, 300), (64, 1100), (1000, 96)])  # 1000: several tiles per persistent program
def test_interp_gemv_folds_match_eager(n, k, norm, gated, gate_first, residual):
    """Each fold against the eager ops it replaces, in fp32 (exact up to summation order; the
    interpreter truncates fp32 -> bf16, so bf16 rounding is checked on the GPU instead)."""
    from offgraph_export.kernels.triton_gemv import triton_gemv

    x, w, nw, res = _fold_inputs(n, k, torch.float32, norm, gated, residual)
    got = triton_gemv(x, w, nw, 1e-5, res, gated, gate_first)
    want = _eager_folds(x, w, nw, 1e-5, res, gated, gate_first)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("norm, gated, gate_first, residual", FOLDS)
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 8192), (16384, 2048), (1000, 4100), (28672, 4096)])  # the last: 8B gate|up
def test_gemv_folds_match_eager_on_cuda(n, k, norm, gated, gate_first, residual):
    """bf16 at the Llama-1B projection shapes (and odd ones): the folds round each intermediate as
    eager does, so the result is as close to a float64 recompute as eager bf16 is."""
    from offgraph_export.kernels.triton_gemv import triton_gemv

    x, w, nw, res = _fold_inputs(n, k, torch.bfloat16, norm, gated, residual, device="cuda", seed=7)
    want = _eager_folds(x.double(), w.double(), None if nw is None else nw.double(), 1e-5,
                        None if res is None else res.double(), gated, gate_first)
    eager = _eager_folds(x, w, nw, 1e-5, res, gated, gate_first)
    got = triton_gemv(x, w, nw, 1e-5, res, gated, gate_first)
    assert torch.isfinite(got.float()).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    eager_err = ((eager.double() - want).norm() / want.norm()).item()
    assert err <= 1.5 * eager_err + 1e-3, f"GEMV error {err:.2e} vs eager bf16 {eager_err:.2e}"


def _decode_program(model, inputs, token_dims, cache_config, fuse=True):
    """The decode method of ``model`` before functionalize (where ``decode_gemv`` runs)."""
    from offgraph_export.passes.specialize_width import specialize_width
    from offgraph_export.pipeline import export_model, run_passes

    ep = export_model(model.requires_grad_(False), inputs, token_dims, cache_config.max_write)
    program = run_passes(ep, inputs, cache_config, "portable", fuse=fuse)
    return specialize_width(program.pass_results["strip_kv_cache"].program, program.step_width).program


def _run_program(ep):
    args, _ = ep.example_inputs
    out = ep.module()(*[a.clone() for a in args])
    return out[0] if isinstance(out, (tuple, list)) else out


@interpreter_only
@pytest.mark.parametrize("source", ["example", "hf_llama"])
def test_interp_decode_gemv_folds_compute_the_same_step(source, tmp_path):
    """The rewritten decode method (every projection a GEMV, norms, SiLU·mul and residual adds
    folded in) computes what the unrewritten one computes, in fp32: the folds are exact rewrites.
    Counted per model: the example has 2 layers with a final norm before its 256-wide head;
    transformers' Llama has 3 layers, and its head reads the final norm through a slice that keeps
    the whole tensor (folded too)."""
    import copy

    from offgraph_export.frontends import load_bundle
    from offgraph_export.passes.decode_gemv import GemvCounts, decode_gemv

    if source == "example":
        from tests.conftest import EXAMPLE

        bundle = load_bundle(EXAMPLE)
        expected = GemvCounts(linears=9, norms=5, gated=2, residuals=4)
    else:
        transformers = pytest.importorskip("transformers")
        from tests.test_frontend_hf import COMMON

        config = transformers.LlamaConfig(**COMMON)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
        bundle = load_bundle(f"hf:{tmp_path}")
        expected = GemvCounts(linears=13, norms=7, gated=3, residuals=6)
    program = _decode_program(bundle.model, bundle.example_inputs, bundle.token_dims, bundle.cache_config)
    want = _run_program(copy.deepcopy(program))
    result = decode_gemv(program, device_types=("cpu",))
    assert result.produced == expected
    left = [str(n.target) for n in program.graph.nodes]
    assert "aten.linear.default" not in left, left
    assert "aten.silu.default" not in left, left
    assert "aten.rsqrt.default" not in left, left
    torch.testing.assert_close(_run_program(program), want, atol=1e-5, rtol=1e-5)


class _MutatesBetween(torch.nn.Module):
    """The linear's input is written in place between the linear and the residual add."""

    def __init__(self, k: int = 64, n: int = 48) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, k))

    def forward(self, x, r):
        h = x * 1.0
        y = torch.nn.functional.linear(h, self.w)
        h.mul_(2.0)
        return y + r, h


class _TwoLinearsOneAdd(torch.nn.Module):
    def __init__(self, k: int = 64, n: int = 48) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(n, k))
        self.b = torch.nn.Parameter(torch.randn(n, k))

    def forward(self, x, y):
        return torch.nn.functional.linear(x, self.a) + torch.nn.functional.linear(y, self.b)


class _ChunkedGateUp(torch.nn.Module):
    """A packed gate|up weight split with ``chunk`` (Phi-3 style), then the down projection."""

    def __init__(self, k: int = 64, f: int = 96) -> None:
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(2 * f, k) / 8)
        self.down = torch.nn.Parameter(torch.randn(k, f) / 8)

    def forward(self, x):
        gate, up = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
        return x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down)


@interpreter_only
@pytest.mark.parametrize(
    "module, inputs, expected",
    [
        # folding the add would move the linear's read of h past h.mul_: only the linear is rewritten
        (_MutatesBetween, ((1, 1, 64), (1, 1, 48)), dict(linears=1, residuals=0)),
        # one add of two linears is folded into one of them, the other stays a plain GEMV
        (_TwoLinearsOneAdd, ((1, 1, 64), (1, 1, 64)), dict(linears=2, residuals=1)),
        (_ChunkedGateUp, ((1, 1, 64),), dict(linears=2, gated=1, residuals=1)),
    ],
    ids=["write-between", "shared-add", "chunked-gate-up"],
)
def test_interp_decode_gemv_folds_only_what_it_may(module, inputs, expected):
    """Folds around writes, shared adds and ``chunk``-split gate|up weights: the counts say what
    fired and the rewritten program computes what the original did."""
    import copy

    from offgraph_export.passes.decode_gemv import GemvCounts, decode_gemv

    torch.manual_seed(0)
    args = tuple(torch.randn(*shape) for shape in inputs)
    ep = torch.export.export(module().requires_grad_(False), args)
    want = copy.deepcopy(ep).module()(*copy.deepcopy(args))
    result = decode_gemv(ep, device_types=("cpu",))
    assert result.produced == GemvCounts(**expected)
    assert not any(n.target is torch.ops.aten.linear.default for n in ep.graph.nodes)
    got = ep.module()(*copy.deepcopy(args))
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


# The rotary embedding folded into the one-token attention kernel (rope_cos/rope_sin).


def _eager_rope(x, cos, sin):
    """Llama's eager rotary form: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _rope_case(dtype, device, window, rows, seed=0, d=32):
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv = 1, 8, 2

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    angles = torch.rand(d // 2, generator=gen) * 40.0
    cos = torch.cat([angles.cos(), angles.cos()]).to(device, dtype).view(1, 1, 1, d)
    sin = torch.cat([angles.sin(), angles.sin()]).to(device, dtype).view(1, 1, 1, d)
    # q and k as transposed views, as a model's projections reach the attention
    q = rand(b, 1, hq, d).transpose(1, 2)
    k = rand(b, 1, hkv, d).transpose(1, 2)
    v = rand(b, hkv, 1, d)
    store = rand(b, hkv, rows, d), rand(b, hkv, rows, d)
    return q, k, v, cos, sin, store


def _check_rope_fold(dtype, device, window, rows, position, d=32, key_tol=None, **tol):
    """The reference rotates in fp32 and rounds once (as the kernel and Inductor do); ``key_tol``
    bounds the stored key's distance from it (None: exact)."""
    q, k, v, cos, sin, (ks, vs) = _rope_case(dtype, device, window, rows, d=d)
    pos = torch.tensor([position], device=device)
    ks2, vs2 = ks.clone(), vs.clone()
    got = triton_update_and_attend(q, k, v, pos, ks, vs, window, d**-0.5, dtype, cos, sin)

    def rotated(x):
        return _eager_rope(x.float(), cos.float(), sin.float()).to(dtype)

    want = triton_update_and_attend(rotated(q), rotated(k), v, pos, ks2, vs2, window, d**-0.5, dtype)
    torch.testing.assert_close(got, want, **tol)
    row = storage_row(position, rows)  # the written row, flat and ring alike
    others = torch.arange(rows, device=device) != row
    torch.testing.assert_close(ks[:, :, others], ks2[:, :, others], atol=0, rtol=0)
    torch.testing.assert_close(vs, vs2, atol=0, rtol=0)
    # the stored key is the rotated one (fp32 contraction may move a bf16 rounding by one unit)
    torch.testing.assert_close(ks[:, :, row], ks2[:, :, row], **(key_tol or dict(atol=0, rtol=0)))


@interpreter_only
@pytest.mark.parametrize(
    "window, rows, position, d", [(None, 256, 200, 32), (16, 16, 200, 32), (None, 64, 0, 32), (None, 64, 40, 80)]
)
def test_interp_rope_in_the_decode_kernel_matches_rotated_inputs(window, rows, position, d):
    """q and k unrotated plus the step's cos/sin rows give what the eager rotation followed by
    the same kernel gives (fp32: the interpreter truncates bf16), flat and ring, a head dim that
    is not a power of two, the row written rotated."""
    _check_rope_fold(torch.float32, "cpu", window, rows, position, d=d, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("window, rows, position", [(None, 4096, 3000), (16, 16, 200)])
def test_cuda_rope_in_the_decode_kernel_matches_rotated_inputs(window, rows, position):
    """bf16 on the GPU: the kernel rotates in fp32 and rounds once, so the stored key is within
    one bf16 unit of the fp32 rotation rounded once (contraction into an FMA may move a tie)."""
    _check_rope_fold(
        torch.bfloat16, "cuda", window, rows, position, atol=2e-2, rtol=2e-2, key_tol=dict(atol=1e-5, rtol=2**-7)
    )


@needs_triton
def test_rope_rows_are_refused_for_a_multi_token_step():
    q, k, v, cos, sin, (ks, vs) = _rope_case(torch.float32, "cpu", None, 64)
    q2, k2, v2 = (torch.cat([x, x], 2) for x in (q, k, v))
    with pytest.raises(RuntimeError, match="one-token steps only"):
        triton_update_and_attend(q2, k2, v2, torch.tensor([3, 4]), ks, vs, None, 0.2, torch.float32, cos, sin)
