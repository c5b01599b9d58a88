"""The step implementations take q/k/v/position in any strides (issue 24: fused q|k|v models).

A model with a fused q|k|v projection (the Phi-3 family) hands the step transposed slices of one
``[B, T, (Hq + 2 Hkv) D]`` tensor, and the layout the step is traced with at export need not be the
one it gets when AOTInductor compiles it: Inductor's decompositions re-derive an intermediate's
strides (``cat`` whose other inputs are empty, as Phi-3's rotary ``cat([rotated, q_pass])`` is
with a full rotary dim, becomes a stride-preserving ``clone``), so the rotated q that export saw
contiguous arrives transposed. Before the fix the portable step had recorded its merging
``reshape`` of q as a ``view`` of the contiguous layout, which then failed to compile ("Cannot view
a tensor with shape [1, 4, s27, 16] and strides (64*s27, 16, 64, 1) ..."), and the Triton steps
(one-session and paged) passed their kernels stride numbers fixed at export, for a layout Inductor
then did not give them (wrong addresses, silently, on the GPU).

* eager calls of each implementation (Triton ones in the interpreter child, ``test_interp_*``),
  q/k/v made exactly as Phi-3's attention makes them, against the same call on ``.contiguous()``
  copies. Eager calls held before the fix too (eager ``reshape`` copies where it must; the kernels
  are given the real strides): they pin the contract, the failures were in traced programs;
* traced with one layout, run with another (portable, portable paged): what compiling may do to
  the step, without a compile;
* a Phi-3 attention block exported, decomposed as the functionalize pass does, then with
  Inductor's decompositions (what AOTInductor traces): the portable steps run and match eager,
  and every Triton kernel gets its tensors in the layout it was traced for;
* end to end: a tiny transformers Phi-3 exported for cpu and checked against transformers.

The portable paged step already took any strides (its one reshape of q splits a dim, and its
``einsum`` stays one op until Inductor decomposes it against the layout it gets); it is tested
the same way.
"""

from __future__ import annotations

import pytest
import torch

from offgraph_export.compat import decompose, dynamic_dim, unlifted_module
from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.kernels.portable_paged import portable_paged_update_and_attend
from offgraph_export.specs.manifest import paged_row, pages_for, ring_rows
from tests.triton_testing import HAVE_TRITON, INTERPRETING, interpreter_only, needs_triton, run_interpreter_cases

if HAVE_TRITON:
    from offgraph_export.kernels.paged_attend import triton_paged_update_and_attend
    from offgraph_export.kernels.triton_attend import triton_update_and_attend

HQ, HKV, D = 4, 2, 16
MAX_WRITE = 16
TOL = dict(atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Inputs as Phi-3 makes them
# ---------------------------------------------------------------------------------------------


def phi3_qkv(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    """q, k, v from a fused projection ``[B, T, (hq + 2 hkv) d]``, as transformers'
    ``Phi3Attention.forward`` takes them: slices of the last dim, each viewed ``[B, T, H, d]``
    and transposed to ``[B, H, T, d]`` (non-contiguous views of the one projection)."""
    hidden_shape = (*qkv.shape[:-1], -1, d)
    query_pos = hq * d
    q = qkv[..., :query_pos]
    k = qkv[..., query_pos : query_pos + hkv * d]
    v = qkv[..., query_pos + hkv * d :]
    return (x.view(hidden_shape).transpose(1, 2) for x in (q, k, v))


def fused_inputs(t: int, start: int, gen: torch.Generator, position_layout: str = "1d", hq: int = HQ, hkv: int = HKV):
    """(q, k, v, position) of a step of ``t`` tokens from ``start``: q/k/v views of one fused
    projection; ``position`` ``[T]``, ``[T, 1]`` or a strided ``[T, 1]`` column of a ``[T, 2]``."""
    qkv = torch.randn(1, t, (hq + 2 * hkv) * D, generator=gen)
    q, k, v = phi3_qkv(qkv, hq, hkv, D)
    assert not q.is_contiguous() or t == 1
    pos = torch.arange(start, start + t)
    if position_layout == "2d":
        pos = pos[:, None]
    elif position_layout == "strided":
        pos = torch.stack([pos, torch.zeros_like(pos)], dim=1)[:, :1]
        assert pos.stride() == (2, 1)
    return q, k, v, pos


def dense(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous() for x in xs]


def flat_storage(window: int | None, gen: torch.Generator, rows: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage ``[1, Hkv, rows, D]`` with finite values in every row (earlier steps' rows)."""
    rows = rows if window is None else ring_rows(window, MAX_WRITE)
    return torch.randn(1, HKV, rows, D, generator=gen), torch.randn(1, HKV, rows, D, generator=gen)


class PagedBatch:
    """One session (slot 1 of 2; slot 0 the scratch) with ``history`` positions held, bringing
    ``t`` tokens: its storage (a shuffled page pool, or one ring per slot) and batch inputs."""

    def __init__(self, window: int | None, history: int, t: int, gen: torch.Generator, page_size: int = 4) -> None:
        self.window = window
        end = history + t
        if window is None:
            pps = pages_for(48, page_size)
            pool = 1 + pps
            self.page_table = torch.zeros(2, pps, dtype=torch.int32)
            self.page_table[1] = (torch.randperm(pps, generator=gen) + 1).to(torch.int32)
            shape = (pool, page_size, HKV, D)
            rows = paged_row(self.page_table[1].long(), torch.arange(history, end), page_size)
        else:
            self.page_table = torch.zeros(2, 1, dtype=torch.int32)
            shape = (2, HKV, ring_rows(window, MAX_WRITE), D)
            rows = torch.zeros(t, dtype=torch.int64)  # unread by ring layers
        self.k_store = torch.randn(shape, generator=gen)
        self.v_store = torch.randn(shape, generator=gen)
        self.batch = [
            torch.ones(t, dtype=torch.int32),  # token_slots
            rows.to(torch.int32),  # token_rows
            self.page_table,
            torch.tensor([0, end], dtype=torch.int32),  # session_lengths, after this step
        ]


def run_both(step, args_fused, args_dense, stores):
    """The step on fused views and on contiguous copies, each on its own copy of the storage;
    outputs and storage must agree."""
    k1, v1 = (s.clone() for s in stores)
    k2, v2 = (s.clone() for s in stores)
    got = step(*args_fused[:4], k1, v1, *args_fused[4:])
    want = step(*args_dense[:4], k2, v2, *args_dense[4:])
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(k1, k2, atol=0, rtol=0)
    torch.testing.assert_close(v1, v2, atol=0, rtol=0)
    assert torch.isfinite(got).all()


# (tokens, history, window, position layout): a prefill chunk, a decode step, ring layers
STEPS = [
    (5, 7, None, "1d"),
    (1, 9, None, "2d"),
    (6, 20, 8, "strided"),
    (1, 30, 8, "1d"),
]
STEP_IDS = [f"T{t}-h{h}-{'flat' if w is None else f'ring{w}'}-{p}" for t, h, w, p in STEPS]


def _flat_step_case(step, t, history, window, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, pos = fused_inputs(t, history, gen, layout)
    stores = flat_storage(window, gen)
    tail = [window, D**-0.5, torch.float32]
    run_both(step, [q, k, v, pos, *tail], [*dense(q, k, v, pos), *tail], stores)


def _paged_step_case(step, t, history, window, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, pos = fused_inputs(t, history, gen, layout)
    paged = PagedBatch(window, history, t, gen)
    tail = [*paged.batch, window, D**-0.5, torch.float32]
    run_both(step, [q, k, v, pos, *tail], [*dense(q, k, v, pos), *tail], (paged.k_store, paged.v_store))


# ---------------------------------------------------------------------------------------------
# Eager: fused views against contiguous copies
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("t", "history", "window", "layout"), STEPS, ids=STEP_IDS)
def test_portable_takes_fused_qkv_views(t, history, window, layout):
    _flat_step_case(portable_update_and_attend, t, history, window, layout)


@pytest.mark.parametrize(("t", "history", "window", "layout"), STEPS, ids=STEP_IDS)
def test_portable_paged_takes_fused_qkv_views(t, history, window, layout):
    _paged_step_case(portable_paged_update_and_attend, t, history, window, layout)


@needs_triton
def test_any_strides_interpreter_suite():
    """The ``test_interp_*`` cases below, in a child process with ``TRITON_INTERPRET=1``."""
    run_interpreter_cases(__file__)


@interpreter_only
@pytest.mark.parametrize(("t", "history", "window", "layout"), STEPS, ids=STEP_IDS)
def test_interp_triton_takes_fused_qkv_views(t, history, window, layout):
    """T=1 takes the one-token kernels, T>1 the multi-token ones."""
    _flat_step_case(triton_update_and_attend, t, history, window, layout)
    # and against the portable step on the same fused views
    gen = torch.Generator().manual_seed(1)
    q, k, v, pos = fused_inputs(t, history, gen, layout)
    k_store, v_store = flat_storage(window, gen)
    k2, v2 = k_store.clone(), v_store.clone()
    got = triton_update_and_attend(q, k, v, pos, k_store, v_store, window, D**-0.5, torch.float32)
    want = portable_update_and_attend(q, k, v, pos, k2, v2, window, D**-0.5, torch.float32)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@interpreter_only
@pytest.mark.parametrize(("t", "history", "window", "layout"), STEPS, ids=STEP_IDS)
def test_interp_triton_paged_takes_fused_qkv_views(t, history, window, layout):
    _paged_step_case(triton_paged_update_and_attend, t, history, window, layout)


# ---------------------------------------------------------------------------------------------
# Traced with one layout, run with another (what compiling may do to the step)
# ---------------------------------------------------------------------------------------------


class _Step(torch.nn.Module):
    def __init__(self, step, window) -> None:
        super().__init__()
        self.step, self.window = step, window

    def forward(self, q, k, v, position, k_store, v_store, *batch):
        return self.step(q, k, v, position, k_store, v_store, *batch, self.window, D**-0.5, torch.float32)


def token_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` as the transpose of a dense ``[B, T, H, D]`` (the layout of a q rotated
    elementwise from fused views, which Inductor's ``cat`` decomposition keeps)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


#: (layout traced, layout run)
LAYOUTS = {
    "contiguous-then-fused": ("contiguous", "fused"),
    "fused-then-contiguous": ("fused", "contiguous"),
    "token_major-then-contiguous": ("token_major", "contiguous"),
    "contiguous-then-token_major": ("contiguous", "token_major"),
}


@pytest.mark.parametrize("paged", [False, True], ids=["portable", "portable_paged"])
@pytest.mark.parametrize("window", [None, 8], ids=["flat", "ring"])
@pytest.mark.parametrize("order", list(LAYOUTS))
def test_portable_traced_in_one_layout_runs_in_another(paged, window, order):
    """Export the step alone on inputs of one layout, run the program on the other layout: its
    views must not depend on the layout export saw (AOTInductor may hand it another)."""
    step = portable_paged_update_and_attend if paged else portable_update_and_attend
    t, history = 6, 10
    gen = torch.Generator().manual_seed(3)
    q, k, v, pos = fused_inputs(t, history, gen, "2d")
    layouts = {
        "fused": [q, k, v, pos],
        "contiguous": dense(q, k, v, pos),
        "token_major": [token_major(q), token_major(k), token_major(v), pos],
    }
    traced, run = (layouts[name] for name in LAYOUTS[order])
    if paged:
        b = PagedBatch(window, history, t, gen)
        stores, batch = (b.k_store, b.v_store), b.batch
    else:
        stores, batch = flat_storage(window, gen), []
    module = _Step(step, window)
    ep = decompose(torch.export.export(module, (*traced, *(s.clone() for s in stores), *batch), strict=False))
    k1, v1 = (s.clone() for s in stores)
    k2, v2 = (s.clone() for s in stores)
    got = unlifted_module(ep)(*run, k1, v1, *batch)
    want = module(*run, k2, v2, *batch)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(k1, k2, atol=0, rtol=0)
    torch.testing.assert_close(v1, v2, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# A Phi-3 attention block through export and Inductor's decompositions
# ---------------------------------------------------------------------------------------------


class Phi3Block(torch.nn.Module):
    """Phi-3's attention up to the step: the fused projection, its views (:func:`phi3_qkv`),
    transformers' own ``apply_rotary_pos_emb`` over the whole head dim (its ``q_pass`` is empty),
    then the step (flat storage, or the paged step with the four batch inputs)."""

    def __init__(self, step, window: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv_proj = torch.nn.Linear(64, (HQ + 2 * HKV) * D, bias=False)
        self.step, self.window = step, window
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), persistent=False)

    def forward(self, x, position, k_store, v_store, *batch):
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

        q, k, v = phi3_qkv(self.qkv_proj(x), HQ, HKV, D)
        freqs = position.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
        return self.step(q, k, v, position, k_store, v_store, *batch, self.window, D**-0.5, torch.float32)


def _block_program(step, window: int | None, paged: bool):
    """(block, example inputs, the exported program decomposed as the passes do, then with
    Inductor's decompositions, as AOTInductor traces it). T is dynamic, as in the pipeline."""
    pytest.importorskip("transformers")
    from torch._inductor.decomposition import select_decomp_table

    t, history = 5, 7
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, t, 64, generator=gen)
    position = torch.arange(history, history + t)
    width = dynamic_dim(1, MAX_WRITE)
    if paged:
        b = PagedBatch(window, history, t, gen)
        stores, batch = [b.k_store, b.v_store], b.batch
        shapes = ({1: width}, {0: width}, {}, {}, ({0: width}, {0: width}, {}, {}))  # *batch: one tuple
    else:
        stores, batch = list(flat_storage(window, gen)), []
        shapes = ({1: width}, {0: width}, {}, {})
    block = Phi3Block(step, window)
    args = (x, position, *stores, *batch)
    ep = torch.export.export(block, tuple(a.clone() for a in args), dynamic_shapes=shapes, strict=False)
    exported = decompose(ep)
    return block, args, exported, exported.run_decompositions(select_decomp_table())


@pytest.mark.parametrize("paged", [False, True], ids=["portable", "portable_paged"])
@pytest.mark.parametrize("window", [None, 8], ids=["flat", "ring"])
def test_portable_phi3_block_survives_inductor_decompositions(paged, window):
    """What failed to compile: Inductor's ``cat`` decomposition hands the step a transposed q."""
    step = portable_paged_update_and_attend if paged else portable_update_and_attend
    block, args, _, compiled = _block_program(step, window, paged)
    a, b = [x.clone() for x in args], [x.clone() for x in args]
    got = unlifted_module(compiled)(*a)
    want = block(*b)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[2], b[2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[3], b[3], atol=1e-6, rtol=1e-6)


def _kernel_layouts(program) -> list[tuple[str, dict[str, tuple[int, ...]]]]:
    """Each Triton kernel launch of the graph in order: its name and the strides (at the example
    sizes) of the tensors it is given, by argument name."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    def concrete(s):
        return s if isinstance(s, int) else int(s.node.hint)

    launches = []
    for n in program.graph.nodes:
        if "triton_kernel_wrapper" not in str(n.target):
            continue
        tensors = {
            name: tuple(concrete(s) for s in arg.meta["val"].stride())
            for name, arg in n.kwargs["kwargs"].items()
            if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)
        }
        launches.append((kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__, tensors))
    return launches


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="export traces the kernels, not the interpreter")
@pytest.mark.parametrize("paged", [False, True], ids=["triton", "triton_paged"])
@pytest.mark.parametrize("window", [None, 8], ids=["flat", "ring"])
def test_triton_kernels_get_the_layout_they_were_traced_for(paged, window):
    """The kernels' stride arguments are numbers fixed at export; Inductor then gives each kernel
    its tensors in the layout of its own trace (exact strides). The two must agree for every
    tensor of every launch, or a kernel reads q from the wrong addresses (silently)."""
    step = triton_paged_update_and_attend if paged else triton_update_and_attend
    _, _, exported, compiled = _block_program(step, window, paged)
    traced, got = _kernel_layouts(exported), _kernel_layouts(compiled)
    assert traced and [name for name, _ in traced] == [name for name, _ in got]
    assert any("q_ptr" in tensors for _, tensors in traced)
    for (name, want), (_, have) in zip(traced, got):
        assert have == want, f"{name}: traced with strides {want}, compiled with {have}"


# ---------------------------------------------------------------------------------------------
# End to end: a tiny transformers Phi-3 through export and check
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_phi3_exports_for_cpu_and_passes_check(tmp_path):
    """Phi3ForCausalLM (fused qkv_proj, 2 layers, hidden 64, 4 heads, 2 kv heads, vocab 128,
    random weights) exported for cpu, checked against transformers' own eager model."""
    transformers = pytest.importorskip("transformers")
    from offgraph_export.check import check_artifact
    from offgraph_export.frontends import load_bundle
    from offgraph_export.frontends.hf import TransformersOracle
    from offgraph_export.pipeline import export_and_lower
    from offgraph_export.runtime import Artifact
    from tests.test_frontend_hf import CACHE, COMMON

    config = transformers.Phi3Config(
        **{**COMMON, "vocab_size": 128, "num_hidden_layers": 2}, architectures=["Phi3ForCausalLM"]
    )
    model_dir = tmp_path / "phi3"
    config.save_pretrained(model_dir)
    ref = f"hf:{model_dir}"
    bundle = load_bundle(ref, **CACHE)
    assert hasattr(bundle.model.hf.model.layers[0].self_attn, "qkv_proj"), "not a fused q|k|v model"
    path, program, _ = export_and_lower(bundle, tmp_path / "phi3.pt2", model=ref, device="cpu")
    assert program.manifest.layer_ids == [0, 1]
    assert isinstance(bundle.oracle(program.manifest), TransformersOracle)
    report = check_artifact(Artifact.load(path), bundle)
    assert report.passed, report.render()
    assert report.growths >= 1
    assert max(s.max_abs_err for s in report.steps) < 1e-4
