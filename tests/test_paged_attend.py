"""The Triton batched (paged) step against the portable one, its reference semantics (design
section 10, ``kernels/paged_attend.py`` against ``kernels/portable_paged.py``).

* ``test_interp_*``: the kernels run in the Triton interpreter on CPU tensors. The interpreter is
  chosen when ``triton.jit`` decorates a kernel (``TRITON_INTERPRET`` at import time), so
  ``test_paged_interpreter_suite`` runs them in a child pytest with ``TRITON_INTERPRET=1``; in the
  parent they skip. Directly: ``TRITON_INTERPRET=1 pytest tests/test_paged_attend.py -k
  test_interp_``.
* CPU tests that need triton importable but run no kernel: ``torch.export`` tracing of the op,
  the split rule, argument errors.
* ``cuda``: the interpreter cases on a GPU, plus larger ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from offgraph_export.errors import ExportError
from offgraph_export.kernels.portable_paged import portable_paged_update_and_attend
from offgraph_export.specs.manifest import paged_row, pages_for, ring_rows
from tests.triton_testing import HAVE_TRITON, INTERPRETING, interpreter_only, needs_cuda, needs_triton, run_interpreter_cases

if HAVE_TRITON:
    from offgraph_export.kernels import paged_attend
    from offgraph_export.kernels.paged_attend import OP_NAME, triton_paged_update_and_attend


# ---------------------------------------------------------------------------------------------
# Batched steps and the comparison harness
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One layer and a batch: each session ``(history, tokens)`` has ``history`` positions
    already in storage (filled directly) and brings ``tokens`` tokens this step (1: decode, more:
    a prefill chunk); ``padding`` scratch tokens (slot 0, position 0) close the step. Then
    ``decode_after`` steps of one token per session. One slot stays idle."""

    id: str
    sessions: tuple[tuple[int, int], ...]
    window: int | None = None  # None: a flat (paged) layer
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dv: int = 16
    page_size: int = 4
    max_capacity: int = 96
    max_write: int = 16
    padding: int = 0
    decode_after: int = 0
    store_dtype: torch.dtype = torch.float32
    out_dtype: torch.dtype | None = None  # None: the storage dtype (q/k/v are in it)
    position_2d: bool = False
    #: the kernels' split settings (None: the module's): small ones make short histories split
    min_split_keys: int | None = 16
    max_block_n: int | None = 16
    seed: int = 0


def _tolerance(*dtypes: torch.dtype) -> dict[str, float]:
    if torch.bfloat16 in dtypes:
        return dict(atol=2e-2, rtol=2e-2)
    if torch.float16 in dtypes:
        return dict(atol=5e-3, rtol=5e-3)
    return dict(atol=2e-5, rtol=2e-5)


class Batch:
    """The runtime's bookkeeping for one case: slots (a random order, one left idle), pages (a
    shuffled pool, so page tables name pages out of order; two pages nobody owns), the storage
    (NaN everywhere but the rows holding a session's history) and the batch inputs of a step."""

    def __init__(self, case: Case, device: str) -> None:
        self.case = case
        self.device = device
        self.gen = torch.Generator().manual_seed(case.seed)
        n = len(case.sessions)
        self.max_sessions = n + 1
        slots = (torch.randperm(self.max_sessions, generator=self.gen) + 1).tolist()
        self.slots = slots[:n]  # slots[-1] stays idle
        self.lengths = [h for h, _ in case.sessions]
        ps = case.page_size
        self.pages_per_session = pages_for(case.max_capacity, ps)
        finals = [h + t + case.decode_after for h, t in case.sessions]
        assert all(f <= case.max_capacity for f in finals)
        needed = [pages_for(f, ps) for f in finals]
        self.pool_pages = 1 + sum(needed) + 2
        order = (torch.randperm(self.pool_pages - 1, generator=self.gen) + 1).tolist()
        self.page_table = torch.zeros(self.max_sessions + 1, self.pages_per_session, dtype=torch.int32)
        for slot, count in zip(self.slots, needed):
            self.page_table[slot, :count] = torch.tensor(order[:count], dtype=torch.int32)
            order = order[count:]
        self.rows = ring_rows(case.window, case.max_write) if case.window is not None else None
        self.k_store, self.v_store = self._poisoned_storage()

    def _poisoned_storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.case
        nan = float("nan")
        if c.window is None:
            shapes = [(self.pool_pages, c.page_size, c.hkv, dim) for dim in (c.d, c.dv)]
        else:
            shapes = [(self.max_sessions + 1, c.hkv, self.rows, dim) for dim in (c.d, c.dv)]
        k_store, v_store = (torch.full(s, nan, dtype=c.store_dtype) for s in shapes)
        for slot, history in zip(self.slots, self.lengths):
            for store, dim in ((k_store, c.d), (v_store, c.dv)):
                if c.window is None:
                    pool = store.view(-1, c.hkv, dim)
                    rows = paged_row(self.page_table[slot].long(), torch.arange(history), c.page_size)
                    pool[rows] = torch.randn(history, c.hkv, dim, generator=self.gen).to(store.dtype)
                else:
                    held = torch.arange(max(0, history - self.rows), history)
                    values = torch.randn(c.hkv, len(held), dim, generator=self.gen).to(store.dtype)
                    store[slot][:, held % self.rows] = values
        return k_store.to(self.device), v_store.to(self.device)

    def step(self, widths: list[int]):
        """q, k, v, position and the four batch inputs of a step in which session ``i`` brings
        ``widths[i]`` tokens: decode tokens first, then prefill chunks, then the padding. q/k/v
        are ``[1, T, H, D]`` projections transposed to ``[1, H, T, D]`` (non-contiguous), as a
        model makes them; padding tokens all share one token's values, as the scratch token at
        position 0 has. Commits the sessions' new lengths."""
        c = self.case
        order = sorted(range(len(widths)), key=lambda i: widths[i] != 1)
        slots, positions, rows = [], [], []
        for i in order:
            start = self.lengths[i]
            for p in range(start, start + widths[i]):
                slots.append(self.slots[i])
                positions.append(p)
                rows.append(paged_row(self.page_table[self.slots[i]].tolist(), p, c.page_size))
            self.lengths[i] += widths[i]
        slots += [0] * c.padding
        positions += [0] * c.padding
        rows += [0] * c.padding  # row 0 of the scratch page
        t = len(slots)
        n_real = t - c.padding

        def projections(heads: int, dim: int) -> torch.Tensor:
            x = torch.randn(1, n_real + 1, heads, dim, generator=self.gen)
            x = torch.cat([x[:, :n_real], x[:, n_real:].expand(1, c.padding, heads, dim)], dim=1)
            return x.to(self.device, c.store_dtype).transpose(1, 2)

        q, k, v = projections(c.hq, c.d), projections(c.hkv, c.d), projections(c.hkv, c.dv)
        lengths = torch.zeros(self.max_sessions + 1, dtype=torch.int32)
        for slot, length in zip(self.slots, self.lengths):
            lengths[slot] = length
        lengths[0] = 1 if c.padding else 0
        position = torch.tensor(positions, dtype=torch.int64, device=self.device)
        if c.position_2d:
            position = position[:, None]
        batch = [
            torch.tensor(slots, dtype=torch.int32),
            torch.tensor(rows, dtype=torch.int32),
            self.page_table.clone(),
            lengths,
        ]
        return q, k, v, position, [x.to(self.device) for x in batch]


def run_case(case: Case, device: str) -> None:
    """Every step through both implementations, each on its own copy of the storage: outputs
    within the dtype's tolerance and finite (no NaN leaked from a poisoned row), the storage
    bit for bit (NaN where NaN)."""
    batch = Batch(case, device)
    k_tri, v_tri = batch.k_store, batch.v_store
    k_ref, v_ref = k_tri.clone(), v_tri.clone()
    out_dtype = case.out_dtype or case.store_dtype
    tol = _tolerance(case.store_dtype, out_dtype)
    scale = case.d**-0.5
    steps = [[t for _, t in case.sessions]] + [[1] * len(case.sessions)] * case.decode_after
    for n, widths in enumerate(steps):
        q, k, v, position, inputs = batch.step(widths)
        out = triton_paged_update_and_attend(
            q, k, v, position, k_tri, v_tri, *inputs, case.window, scale, out_dtype
        )
        ref = portable_paged_update_and_attend(
            q, k, v, position, k_ref, v_ref, *inputs, case.window, scale, out_dtype
        )
        where = f"{case.id} step {n} (T={q.shape[2]})"
        assert out.shape == ref.shape and out.dtype == out_dtype, where
        # token-major (attend_common.attention_output): the model's transpose before o_proj is a view
        assert out.transpose(1, 2).is_contiguous(), f"{where}: output strides {out.stride()}"
        assert torch.isfinite(out.float()).all(), f"{where}: non-finite output (NaN leaked?)"
        torch.testing.assert_close(out.float(), ref.float(), msg=lambda m: f"{where}: {m}", **tol)
        torch.testing.assert_close(k_tri, k_ref, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{where} K: {m}")
        torch.testing.assert_close(v_tri, v_ref, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{where} V: {m}")


def _settings(monkeypatch, case: Case) -> None:
    if case.min_split_keys is not None:
        monkeypatch.setattr(paged_attend, "_MIN_SPLIT_KEYS", case.min_split_keys)
    if case.max_block_n is not None:
        monkeypatch.setattr(paged_attend, "_MAX_BLOCK_N", case.max_block_n)


MIXED = ((40, 1), (0, 7), (13, 1), (22, 5))  # decode, prefill from empty, decode, prefill chunk

CASES = [
    # Flat (paged) layers: page sizes 1, 4, 16 (16 with 16-key blocks: one page per block; the
    # others look pages up per key row), one session decoding alone (several splits + combine),
    # mixed decode and prefill with padding (one split), two decoders (splits of ceil(S_max/2)).
    Case("flat_ps4_mixed_padding", MIXED, padding=2, decode_after=1),
    Case("flat_ps1_mixed", MIXED, page_size=1, padding=1),
    Case("flat_ps16_one_page_blocks", MIXED, page_size=16, padding=3),
    Case("flat_ps16_gathered_blocks", ((70, 1), (5, 6)), page_size=16, max_block_n=64),
    Case("flat_decode_alone_splits", ((90, 1),), decode_after=1),
    Case("flat_two_decoders", ((75, 1), (33, 1)), page_size=16, decode_after=1),
    Case("flat_mqa_dv_ne_d", MIXED, hq=8, hkv=1, d=32, dv=16, page_size=4, padding=1),
    Case("flat_gqa_d_not_pow2", ((30, 1), (9, 4)), hq=6, hkv=2, d=24, dv=40, position_2d=True),
    Case("flat_bf16", MIXED, store_dtype=torch.bfloat16, padding=2),
    Case("flat_fp16", ((50, 1), (7, 4)), store_dtype=torch.float16, padding=1),  # 16-bit tl.dot
    Case("flat_bf16_fp32_out", ((60, 1), (3, 3)), store_dtype=torch.bfloat16, out_dtype=torch.float32),
    Case("flat_default_split_settings", ((90, 1), (2, 9)), min_split_keys=None, max_block_n=None),
    # Ring layers: windows shorter than the history (wrapped rings), a prefill chunk whose early
    # tokens see older rows than its last one, decode alone over a long ring.
    Case("ring_mixed_padding", MIXED, window=8, max_write=8, padding=2, decode_after=1),
    Case("ring_decode_alone_splits", ((200, 1),), window=64, max_capacity=256, decode_after=1),
    Case("ring_chunk_wraps", ((30, 8), (5, 1), (0, 3)), window=6, max_write=8, decode_after=1),
    Case("ring_window_past_history", ((3, 1), (0, 5)), window=32, padding=1),
    Case("ring_mqa_dv_ne_d", MIXED, window=12, hq=8, hkv=1, d=32, dv=16, padding=1),
    Case("ring_bf16", MIXED, window=10, store_dtype=torch.bfloat16, padding=1),
]


# ---------------------------------------------------------------------------------------------
# Interpreter (CPU) tests
# ---------------------------------------------------------------------------------------------


@needs_triton
def test_paged_interpreter_suite():
    """Run the ``test_interp_*`` cases in a child process with ``TRITON_INTERPRET=1``."""
    run_interpreter_cases(__file__)


@interpreter_only
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_interp_matches_portable(case, monkeypatch):
    _settings(monkeypatch, case)
    run_case(case, "cpu")


@interpreter_only
@pytest.mark.parametrize(
    "sessions, min_split_keys, splits, combined",
    [(((90, 1),), 16, 64, True), (((75, 1), (33, 1)), 16, 32, True), (MIXED, 16, 5, True), (MIXED, 96, 1, False)],
    ids=["one_decoder", "two_decoders", "mixed", "mixed_one_split"],
)
def test_interp_split_launches(monkeypatch, sessions, min_split_keys, splits, combined):
    """The launches a step makes: the attention grid ``(T, Hkv, ceil(S_all / T))`` (``S_all`` 64
    here: 128 SMs counted on cpu, 4 programs each, 2 kv heads; most splits of a 90-position history
    find an empty range), or ``S`` 1 where the capacity (96 positions) fits one 96-key split; the
    combine only when ``S`` > 1, and
    with several splits the partial rows of every split written (their buffers are NaN-filled
    first: an empty split leaves ``(-inf, 0, 0)``), where the output is still the portable one."""
    case = Case("spy", sessions, min_split_keys=min_split_keys)
    _settings(monkeypatch, case)
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                name = self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else str(self.kernel)
                if "attend" in name and grid[2] > 1:
                    for buffer in args[8:11]:
                        buffer.fill_(float("nan"))
                self.kernel[grid](*args, **kwargs)
                if "attend" in name and grid[2] > 1:
                    assert not any(b.isnan().any() for b in args[8:11]), "a partial row was not written"
                launches.append((name, tuple(grid)))
            return launch

    monkeypatch.setattr(torch.library, "wrap_triton", Spy)
    run_case(case, "cpu")
    names = [name for name, _ in launches]
    t = sum(w for _, w in sessions)
    # one token: the row write folded into the attention kernel (no write launch)
    expected = ["_paged_attend_kernel"] if t == 1 else ["_paged_write_kernel", "_paged_attend_kernel"]
    assert names[: len(expected)] == expected, names
    attend = len(expected) - 1
    assert launches[attend][1] == (t, case.hkv, splits), launches
    assert ("_paged_combine_kernel" in names) == combined, names
    if combined:
        assert launches[attend + 1][1] == (t, case.hq, 1), launches


def _rope_rows(d: int, gen: torch.Generator, device: str):
    angles = torch.rand(d // 2, generator=gen) * 40.0
    cos = torch.cat([angles.cos(), angles.cos()]).to(device).view(1, 1, d)
    sin = torch.cat([angles.sin(), angles.sin()]).to(device).view(1, 1, d)
    return cos, sin


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def run_rope_case(case: Case, device: str, tol: dict) -> None:
    """One-token steps given unrotated q/k and the step's rotary rows (``decode_rope``) against
    the same kernel given q/k rotated eagerly: the same output, and the row written rotated."""
    batch = Batch(case, device)
    gen = torch.Generator().manual_seed(7)
    k_ref, v_ref = batch.k_store.clone(), batch.v_store.clone()
    for n in range(3):
        q, k, v, position, inputs = batch.step([1])
        cos, sin = _rope_rows(case.d, gen, device)
        got = triton_paged_update_and_attend(q, k, v, position, batch.k_store, batch.v_store, *inputs, case.window,
                                             case.d**-0.5, case.store_dtype, cos, sin)
        want = triton_paged_update_and_attend(_rotated(q, cos, sin), _rotated(k, cos, sin), v, position, k_ref, v_ref,
                                              *inputs, case.window, case.d**-0.5, case.store_dtype)
        torch.testing.assert_close(got, want, msg=lambda m: f"{case.id} step {n}: {m}", **tol)
        torch.testing.assert_close(batch.k_store, k_ref, equal_nan=True, **tol)
        torch.testing.assert_close(batch.v_store, v_ref, atol=0, rtol=0, equal_nan=True)


ROPE_CASES = [
    Case("rope_flat", ((40, 1),), min_split_keys=None, max_block_n=None),
    Case("rope_flat_splits", ((90, 1),)),
    Case("rope_ring_wraps", ((50, 1),), window=8, max_write=8),
]


@interpreter_only
@pytest.mark.parametrize("case", ROPE_CASES, ids=[c.id for c in ROPE_CASES])
def test_interp_rope_in_the_one_token_paged_kernel(case):
    run_rope_case(case, "cpu", dict(atol=1e-5, rtol=1e-5))


@needs_triton
def test_paged_rope_rows_are_refused_for_a_multi_token_step():
    case = Case("rope_two", ((5, 2),))
    batch = Batch(case, "cpu")
    q, k, v, position, inputs = batch.step([2])
    cos, sin = _rope_rows(case.d, torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(RuntimeError, match="one-token steps only"):  # the op never promises one row per session
        triton_paged_update_and_attend(q, k, v, position, batch.k_store, batch.v_store, *inputs, None, 0.25,
                                       torch.float32, cos, sin)


def run_fold_case(case: Case, device: str, tol: dict, rope: bool) -> None:
    """Decode steps of several sessions (one token each, then the padding) through the
    one-row-per-session path of ``paged_step`` (row writes folded into the attention kernel, no
    write kernel, q/k/v read in place; with ``rope`` unrotated q/k and one rotary row per token)
    against the portable step given q/k rotated eagerly: outputs within ``tol``, both storages
    bit for bit (NaN where NaN)."""
    batch = Batch(case, device)
    gen = torch.Generator().manual_seed(11)
    k_ref, v_ref = batch.k_store.clone(), batch.v_store.clone()
    out_dtype = case.out_dtype or case.store_dtype
    for n in range(1 + case.decode_after):
        q, k, v, position, inputs = batch.step([1] * len(case.sessions))
        t = q.shape[2]
        cos = sin = None
        q_ref, k_ref_in = q, k
        if rope:
            rows = [_rope_rows(case.d, gen, device) for _ in range(t - case.padding)]
            rows += [rows[0]] * case.padding if case.padding else []  # padding tokens alike
            cos = torch.cat([c for c, _ in rows], 1).to(case.store_dtype)  # [1, T, D]
            sin = torch.cat([s_ for _, s_ in rows], 1).to(case.store_dtype)
            q_ref = _rotated(q, cos[:, None], sin[:, None]).to(case.store_dtype)
            k_ref_in = _rotated(k, cos[:, None], sin[:, None]).to(case.store_dtype)
        got = paged_attend.paged_step(q, k, v, position, batch.k_store, batch.v_store, *inputs, case.window,
                                      case.d**-0.5, out_dtype, rope_cos=cos, rope_sin=sin, one_row_per_session=True)
        want = portable_paged_update_and_attend(q_ref, k_ref_in, v, position, k_ref, v_ref, *inputs, case.window,
                                                case.d**-0.5, out_dtype)
        where = f"{case.id} step {n} (T={t})"
        assert torch.isfinite(got.float()).all(), f"{where}: non-finite output (NaN leaked?)"
        torch.testing.assert_close(got.float(), want.float(), msg=lambda m: f"{where}: {m}", **tol)
        exact = {} if rope else dict(atol=0, rtol=0)  # eager rotation rounds each product; the kernel once
        torch.testing.assert_close(batch.k_store, k_ref, equal_nan=True, msg=lambda m: f"{where} K: {m}", **(exact or tol))
        torch.testing.assert_close(batch.v_store, v_ref, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{where} V: {m}")


FOLD_CASES = [
    Case("fold_flat_ps4", ((40, 1), (0, 1), (13, 1), (22, 1)), padding=2, decode_after=2),
    Case("fold_flat_ps16_gathered", ((70, 1), (5, 1), (33, 1)), page_size=16, max_block_n=64, decode_after=1),
    Case("fold_flat_splits", ((90, 1), (60, 1)), decode_after=1),
    Case("fold_flat_bf16", ((50, 1), (7, 1), (31, 1)), store_dtype=torch.bfloat16, padding=1),
    Case("fold_ring_wraps", ((30, 1), (5, 1), (0, 1)), window=6, max_write=8, decode_after=3),
    Case("fold_ring_bf16_padding", ((50, 1), (12, 1)), window=10, store_dtype=torch.bfloat16, padding=2, decode_after=1),
]


@interpreter_only
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("case", FOLD_CASES, ids=[c.id for c in FOLD_CASES])
def test_interp_one_row_per_session_folds_the_writes(case, rope, monkeypatch):
    _settings(monkeypatch, case)
    tol = _tolerance(case.store_dtype) if case.store_dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    run_fold_case(case, "cpu", tol, rope)


@interpreter_only
def test_interp_one_row_per_session_launches_no_write_kernel(monkeypatch):
    """The folded path launches the attention kernel (and the combine) only: no write kernel."""
    case = Case("fold_launches", ((40, 1), (20, 1), (9, 1)))
    _settings(monkeypatch, case)
    batch = Batch(case, "cpu")
    q, k, v, position, inputs = batch.step([1, 1, 1])
    names = []
    real = torch.library.wrap_triton

    def spy(kernel):
        names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real(kernel)

    monkeypatch.setattr(torch.library, "wrap_triton", spy)
    paged_attend.paged_step(q, k, v, position, batch.k_store, batch.v_store, *inputs, None, 0.25, torch.float32,
                            one_row_per_session=True)
    assert "_paged_write_kernel" not in names and names[0] == "_paged_attend_kernel", names
    names.clear()
    paged_attend.paged_step(q, k, v, position, batch.k_store.clone(), batch.v_store.clone(), *inputs, None, 0.25,
                            torch.float32)
    assert names[0] == "_paged_write_kernel", names


@interpreter_only
def test_interp_out_of_range_writes_are_dropped():
    """A pool row or slot outside the storage (never passed by the runtime) is not written."""
    case = Case("overflow", ((0, 2),))
    batch = Batch(case, "cpu")
    q, k, v, position, (slots, rows, table, lengths) = batch.step([2])
    k_store, v_store = batch.k_store.clone(), batch.v_store.clone()
    bad_rows = torch.tensor([batch.pool_pages * case.page_size, -1], dtype=torch.int32)
    triton_paged_update_and_attend(q, k, v, position, k_store, v_store, slots, bad_rows, table, lengths,
                                   None, 0.25, torch.float32)
    torch.testing.assert_close(k_store, batch.k_store, atol=0, rtol=0, equal_nan=True)
    ring = Case("overflow_ring", ((0, 2),), window=4)
    batch = Batch(ring, "cpu")
    q, k, v, position, (slots, rows, table, lengths) = batch.step([2])
    k_store, v_store = batch.k_store.clone(), batch.v_store.clone()
    bad_slots = torch.tensor([batch.max_sessions + 1, -1], dtype=torch.int32)
    out = triton_paged_update_and_attend(q, k, v, position, k_store, v_store, bad_slots, rows, table, lengths,
                                         4, 0.25, torch.float32)
    torch.testing.assert_close(k_store, batch.k_store, atol=0, rtol=0, equal_nan=True)
    assert (out == 0).all()  # an unknown slot attends nothing


# ---------------------------------------------------------------------------------------------
# CPU tests without kernels
# ---------------------------------------------------------------------------------------------


class _TwoLayerBatchedStep(torch.nn.Module):
    """A flat (paged) and a ring layer sharing q/k/v, fed ``[1, T, H, D]`` projections."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def forward(self, q, k, v, position, k_pool, v_pool, k_ring, v_ring,
                token_slots, token_rows, page_table, session_lengths):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        batch = (token_slots, token_rows, page_table, session_lengths)
        scale = q.shape[-1] ** -0.5
        flat = triton_paged_update_and_attend(q, k, v, position, k_pool, v_pool, *batch, None, scale, q.dtype)
        ring = triton_paged_update_and_attend(q, k, v, position, k_ring, v_ring, *batch, self.window, scale, q.dtype)
        return flat, ring


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="export traces the kernels, not the interpreter")
def test_export_keeps_one_op_node_per_layer_with_dynamic_tokens_and_pages():
    """The host code runs on SymInts (T and the pool's pages stay dynamic, and so does the split
    count ceil(S_max / T)), and export records the op, its storage arguments mutated in place."""
    from torch.export import Dim

    t, pages, ps, hq, hkv, d, slots, window = 5, 9, 4, 4, 2, 16, 4, 8
    rows = ring_rows(window, 16)
    args = (
        torch.randn(1, t, hq, d), torch.randn(1, t, hkv, d), torch.randn(1, t, hkv, d),
        torch.arange(t),
        torch.zeros(pages, ps, hkv, d), torch.zeros(pages, ps, hkv, d),
        torch.zeros(slots, hkv, rows, d), torch.zeros(slots, hkv, rows, d),
        torch.ones(t, dtype=torch.int32), torch.arange(t, dtype=torch.int32),
        torch.zeros(slots, 8, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32),
    )
    T, P = Dim("T", min=2, max=64), Dim("pages", min=2, max=1000)
    shapes = ({1: T}, {1: T}, {1: T}, {0: T}, {0: P}, {0: P}, {}, {}, {0: T}, {0: T}, {}, {})
    ep = torch.export.export(_TwoLayerBatchedStep(window), args, dynamic_shapes=shapes, strict=False)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function" and OP_NAME.split("::")[1] in str(n.target)]
    assert len(nodes) == 2, ep.graph
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    assert isinstance(placeholders["k_pool"].meta["val"].shape[0], torch.SymInt), "pages were specialized"
    assert isinstance(placeholders["q"].meta["val"].shape[1], torch.SymInt), "T was specialized"
    functional = ep.run_decompositions({})  # as the strip pass functionalizes
    mutated = set(functional.graph_signature.user_inputs_to_mutate.values())
    assert mutated == {"k_pool", "v_pool", "k_ring", "v_ring"}, functional.graph_signature
    flat_out, ring_out = (n for n in ep.graph.nodes if n.op == "output").__next__().args[0]
    assert flat_out.meta["val"].shape[1:3] == (hq, placeholders["q"].meta["val"].shape[1])


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="traces the kernels' launches, not the interpreter")
def test_traced_launches_keep_the_split_count_symbolic():
    """What AOTInductor sees when it traces into the op: the three launches, the attention grid's
    split axis and the combine grid expressions of the symbolic ``T`` (not specialized to the
    example's), the same split count handed to both kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    t, pages, ps, hq, hkv, d, slots = 5, 9, 4, 4, 2, 16, 4

    def step(q, k, v, position, k_pool, v_pool, token_slots, token_rows, page_table, lengths):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return paged_attend._paged_step(q, k, v, position, k_pool, v_pool, token_slots, token_rows,
                                        page_table, lengths, None, 0.25, torch.float32)

    args = (
        torch.randn(1, t, hq, d), torch.randn(1, t, hkv, d), torch.randn(1, t, hkv, d), torch.arange(t),
        torch.zeros(pages, ps, hkv, d), torch.zeros(pages, ps, hkv, d),
        torch.ones(t, dtype=torch.int32), torch.arange(t, dtype=torch.int32),
        torch.zeros(slots, 8, dtype=torch.int32), torch.zeros(slots, dtype=torch.int32),
    )
    graph = make_fx(step, tracing_mode="symbolic")(*args).graph
    launches = [n for n in graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    assert len(launches) == 3, graph
    (write_grid,), (attend_grid,), (combine_grid,) = (n.kwargs["grid"] for n in launches)
    splits = launches[1].kwargs["kwargs"]["num_splits"]
    assert isinstance(splits, torch.fx.Node) and attend_grid[2] is splits, attend_grid
    assert launches[2].kwargs["kwargs"]["num_splits"] is splits
    assert isinstance(combine_grid[0], torch.fx.Node), combine_grid


@needs_triton
def test_split_rule():
    """``S = ceil(S_all / T)``: launches of about ``Hkv * S_all`` programs for any T, 1 where the
    capacity fits one split, the combine gate 1 exactly when S > 1, and ``S_all`` from static
    things only."""
    for s_all in (1, 2, 5, 33, 64):
        for t in range(1, 300):
            s = paged_attend._num_splits(t, s_all, False)
            assert s == math.ceil(s_all / t) and s >= 1, (t, s_all)
            assert paged_attend._combine_gate(t, s_all, False) == (1 if s > 1 else 0), (t, s_all)
            assert paged_attend._num_splits(t, s_all, True) == 1 and paged_attend._combine_gate(t, s_all, True) == 0
    cpu = torch.device("cpu")  # 128 SMs counted where there is no GPU
    assert paged_attend._all_splits(8, cpu, 4) == min(paged_attend._MAX_SPLITS, 4 * 128 // 8)
    assert paged_attend._all_splits(8, cpu, 1) == 16
    assert paged_attend._all_splits(1, cpu, 4) == paged_attend._MAX_SPLITS
    assert paged_attend._one_split(64, 64) and not paged_attend._one_split(65, 64)
    # the 1B shape at a 2048-row capacity: 16 tokens get 4 splits, not ceil(32 / 16) = 2
    assert paged_attend._num_splits(16, paged_attend._all_splits(8, cpu, 4), paged_attend._one_split(2048, 64)) == 4


def test_window_must_be_positive():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    x = torch.zeros(1, 1, 1, 16)
    i = torch.zeros(1, dtype=torch.int32)
    for window in (0, -1, True, 2.0):
        with pytest.raises(ExportError, match="window"):
            triton_paged_update_and_attend(x, x, x, i, x, x, i, i, i, i, window, 1.0, torch.float32)


# ---------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------

GPU_CASES = CASES + [
    Case("gpu_flat_decode_32_bf16", tuple((1000 + 37 * i, 1) for i in range(32)), hq=32, hkv=8, d=128,
         dv=128, page_size=16, max_capacity=4096, store_dtype=torch.bfloat16,
         min_split_keys=None, max_block_n=None),
    Case("gpu_flat_mixed_ps64_bf16", ((3000, 1), (0, 200), (500, 64), (4000, 1)), hq=32, hkv=8, d=64,
         dv=64, page_size=64, max_capacity=4096, max_write=512, store_dtype=torch.bfloat16, padding=5,
         min_split_keys=None, max_block_n=None),
    Case("gpu_ring_decode_bf16", tuple((5000 + i, 1) for i in range(8)), window=4096, hq=32, hkv=8,
         d=128, dv=128, max_capacity=8192, store_dtype=torch.bfloat16,
         min_split_keys=None, max_block_n=None),
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_cuda_matches_portable(case, monkeypatch):
    _settings(monkeypatch, case)
    run_case(case, "cuda")
    torch.cuda.synchronize()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("case", FOLD_CASES, ids=[c.id for c in FOLD_CASES])
def test_cuda_one_row_per_session_folds_the_writes(case, rope, monkeypatch):
    _settings(monkeypatch, case)
    tol = _tolerance(case.store_dtype) if case.store_dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    run_fold_case(case, "cuda", tol, rope)
    torch.cuda.synchronize()
