"""The eager reference caches behind the neutral op against an independent oracle.

The oracle recomputes attention over the whole sequence so far with no cache at all:
``scaled_dot_product_attention`` with an explicit boolean mask (causal, and for ring layers the
sliding window ``key_pos > query_pos - window``), GQA by ``repeat_interleave`` of the k/v heads.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import offgraph_export.ops  # noqa: F401  (defines torch.ops.offgraph.update_and_attend)
from offgraph_export.errors import CacheOverflowError, OffgraphError
from offgraph_export.frontends import load_bundle
from offgraph_export.ops import update_and_attend
from offgraph_export.reference import ReferenceCaches
from offgraph_export.specs import CacheConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_llama.py"

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

OP = torch.ops.offgraph.update_and_attend


# --- oracle and helpers ----------------------------------------------------------------------


def oracle(q, k, v, window, scale):
    """Full no-cache attention of every query over the whole sequence, in float32."""
    n = q.shape[2]
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    qp = torch.arange(n)[:, None]
    kp = torch.arange(n)[None, :]
    mask = kp <= qp
    if window is not None:
        mask = mask & (kp > qp - window)
    return F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=mask, scale=scale)


def make_qkv(n, b=1, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, hq, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, dv, generator=g).to(dtype)
    return q, k, v


def config_for(window=None, layer_id=0, max_capacity=1024, max_write=None):
    max_write = max_write if max_write is not None else min(128, max_capacity)
    return CacheConfig(
        max_capacity=max_capacity,
        initial_capacity=min(16, max_capacity),
        max_write=max_write,
        ring_windows={layer_id: window} if window is not None else {},
    )


def step(q, k, v, start, width, layer_id, scale, position_2d=False, op=OP):
    """One step of the neutral op over tokens [start, start + width) of the full tensors."""
    sl = slice(start, start + width)
    position = torch.arange(start, start + width)
    if position_2d:
        position = position[:, None]
    return op(q[:, :, sl], k[:, :, sl], v[:, :, sl], position, layer_id, scale, q.dtype)


def check_steps(q, k, v, chunks, *, window=None, layer_id=0, scale=None, position_2d=False, op=OP):
    """Feed the sequence in ``chunks`` and compare every step's output with the oracle over the
    sequence so far."""
    n = q.shape[2]
    assert sum(chunks) == n
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    caches = ReferenceCaches(config_for(window, layer_id), [layer_id])
    start = 0
    outs = []
    with caches.activate():
        for width in chunks:
            out = step(q, k, v, start, width, layer_id, scale, position_2d, op)
            assert out.shape == (q.shape[0], q.shape[1], width, v.shape[-1])
            assert out.dtype == q.dtype
            end = start + width
            expected = oracle(q[:, :, :end], k[:, :, :end], v[:, :, :end], window, scale)[:, :, start:]
            torch.testing.assert_close(out.float(), expected, **TOL[q.dtype])
            outs.append(out)
            start = end
            assert caches.committed_length == end
    return torch.cat(outs, dim=2)


# --- flat layers -----------------------------------------------------------------------------


def test_oracle_sanity():
    """With no mask restrictions beyond causality, the oracle equals plain causal SDPA."""
    q, k, v = make_qkv(9, hq=2, hkv=2)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(oracle(q, k, v, None, 1 / math.sqrt(16)), expected)


def test_fresh_prefill():
    q, k, v = make_qkv(12)
    check_steps(q, k, v, [12])


def test_single_token_prefill():
    q, k, v = make_qkv(1)
    out = check_steps(q, k, v, [1])
    # One key: attention returns exactly its value.
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))


def test_decode_after_prefill():
    q, k, v = make_qkv(13)
    check_steps(q, k, v, [7, 1, 1, 1, 1, 1, 1])


def test_chunked_prefill_uneven_then_decode():
    q, k, v = make_qkv(23, seed=1)
    check_steps(q, k, v, [5, 1, 3, 8, 2, 1, 1, 1, 1])


def test_chunked_equals_one_shot():
    q, k, v = make_qkv(20, seed=2)
    chunked = check_steps(q, k, v, [3, 9, 1, 7])
    whole = check_steps(q, k, v, [20])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_batch_of_two():
    q, k, v = make_qkv(11, b=2, seed=3)
    check_steps(q, k, v, [4, 6, 1])


def test_explicit_scale_is_used():
    q, k, v = make_qkv(10, seed=4)
    check_steps(q, k, v, [6, 4], scale=0.37)


def test_python_wrapper_is_the_same_op():
    q, k, v = make_qkv(9, seed=5)
    a = check_steps(q, k, v, [4, 5], op=update_and_attend)
    b = check_steps(q, k, v, [4, 5], op=OP)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (8, 1), (4, 4)])
def test_gqa(hq, hkv):
    q, k, v = make_qkv(14, hq=hq, hkv=hkv, seed=6)
    check_steps(q, k, v, [6, 1, 5, 1, 1])


@pytest.mark.parametrize("window", [None, 5])
def test_value_head_dim_differs(window):
    q, k, v = make_qkv(15, hq=4, hkv=2, d=16, dv=8, seed=7)
    out = check_steps(q, k, v, [4, 7, 1, 1, 1, 1], window=window)
    assert out.shape[-1] == 8


@pytest.mark.parametrize("window", [None, 4])
def test_position_as_column(window):
    q, k, v = make_qkv(12, seed=8)
    a = check_steps(q, k, v, [5, 1, 6], window=window, position_2d=True)
    b = check_steps(q, k, v, [5, 1, 6], window=window, position_2d=False)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
def test_dtypes(dtype, window):
    q, k, v = make_qkv(21, hq=8, hkv=2, dtype=dtype, seed=9)
    check_steps(q, k, v, [7, 2, 9, 1, 1, 1], window=window)


def test_nonzero_layer_id():
    q, k, v = make_qkv(10, seed=10)
    check_steps(q, k, v, [4, 6], layer_id=3, window=3)


# --- ring layers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunks",
    [
        [1] * 30,  # pure decode, wraps many times
        [3, 2, 1, 3, 2, 1, 3, 2, 1, 3, 2, 1, 3, 3],  # every chunk smaller than the window
        [9, 1, 7, 13, 1, 1, 8],  # chunks larger than the window
        [4, 4, 4, 4, 4, 4, 4, 4],  # chunks exactly the window
        [37],  # one prefill far longer than the window
    ],
    ids=["decode", "small", "large", "equal", "one-shot"],
)
def test_ring_wraps_past_window(chunks):
    n = sum(chunks)
    q, k, v = make_qkv(n, seed=11)
    check_steps(q, k, v, chunks, window=4)


def test_ring_window_of_one():
    q, k, v = make_qkv(9, seed=12)
    out = check_steps(q, k, v, [3, 1, 5], window=1)
    # Each token sees only itself.
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=1e-6)


def test_ring_differs_from_flat_once_past_window():
    q, k, v = make_qkv(12, seed=13)
    ring = check_steps(q, k, v, [12], window=4)
    flat = check_steps(q, k, v, [12])
    torch.testing.assert_close(ring[:, :, :4], flat[:, :, :4])
    assert not torch.allclose(ring[:, :, 4:], flat[:, :, 4:], atol=1e-3)


def test_ring_is_not_bounded_by_max_capacity():
    """Admission for ring layers is per step (width <= max_write); its history never grows."""
    q, k, v = make_qkv(24, seed=14)
    scale = 0.25
    config = CacheConfig(max_capacity=8, initial_capacity=4, max_write=4, ring_windows={0: 3})
    caches = ReferenceCaches(config, [0])
    with caches.activate():
        for start in range(0, 24, 4):
            out = step(q, k, v, start, 4, 0, scale)
    expected = oracle(q, k, v, 3, scale)[:, :, 20:]
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert caches.committed_length == 24


def test_mixed_flat_and_ring_layers_in_one_set():
    q, k, v = make_qkv(18, seed=15)
    q2, k2, v2 = make_qkv(18, seed=16)
    scale = 0.25
    config = CacheConfig(ring_windows={1: 5})
    caches = ReferenceCaches(config, [0, 1])
    flat_out, ring_out = [], []
    start = 0
    with caches.activate():
        for width in [6, 1, 8, 1, 2]:
            flat_out.append(step(q, k, v, start, width, 0, scale))
            ring_out.append(step(q2, k2, v2, start, width, 1, scale))
            start += width
    assert caches.committed_length == 18
    torch.testing.assert_close(torch.cat(flat_out, 2), oracle(q, k, v, None, scale), **TOL[torch.float32])
    torch.testing.assert_close(torch.cat(ring_out, 2), oracle(q2, k2, v2, 5, scale), **TOL[torch.float32])


# --- several sessions in one process ---------------------------------------------------------


@pytest.mark.parametrize("window", [None, 4])
def test_two_sets_interleaved(window):
    chunks = [5, 3, 1, 1, 7, 1]
    qa, ka, va = make_qkv(18, seed=20)
    qb, kb, vb = make_qkv(18, seed=21)
    alone_a = check_steps(qa, ka, va, chunks, window=window)
    alone_b = check_steps(qb, kb, vb, chunks, window=window)

    scale = 1.0 / math.sqrt(16)
    a = ReferenceCaches(config_for(window), [0])
    b = ReferenceCaches(config_for(window), [0])
    out_a, out_b = [], []
    start = 0
    for i, width in enumerate(chunks):
        if i % 2 == 0:  # alternate which session goes first, and nest the activations
            with a.activate():
                out_a.append(step(qa, ka, va, start, width, 0, scale))
                with b.activate():
                    out_b.append(step(qb, kb, vb, start, width, 0, scale))
        else:
            with b.activate():
                out_b.append(step(qb, kb, vb, start, width, 0, scale))
            with a.activate():
                out_a.append(step(qa, ka, va, start, width, 0, scale))
        start += width
    assert a.committed_length == b.committed_length == 18
    torch.testing.assert_close(torch.cat(out_a, 2), alone_a, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(out_b, 2), alone_b, atol=0, rtol=0)


def test_reset_starts_a_fresh_session():
    q, k, v = make_qkv(10, seed=22)
    scale = 0.25
    caches = ReferenceCaches(config_for(), [0])
    with caches.activate():
        step(q, k, v, 0, 6, 0, scale)
        caches.reset()
        assert caches.committed_length == 0
        out = step(q, k, v, 0, 10, 0, scale)
    torch.testing.assert_close(out, oracle(q, k, v, None, scale), **TOL[torch.float32])


# --- errors ----------------------------------------------------------------------------------


def test_overflow_of_flat_layer():
    q, k, v = make_qkv(10, seed=23)
    scale = 0.25
    caches = ReferenceCaches(config_for(max_capacity=8, max_write=8), [0])
    with caches.activate():
        step(q, k, v, 0, 6, 0, scale)
        with pytest.raises(CacheOverflowError, match=r"capacity of 8 tokens") as info:
            step(q, k, v, 6, 3, 0, scale)
        assert "layer 0" in str(info.value)
        # The failed step left the cache as it was: the session continues up to the capacity.
        assert caches.committed_length == 6
        out = step(q, k, v, 6, 2, 0, scale)
        assert caches.committed_length == 8
        with pytest.raises(CacheOverflowError, match=r"8"):
            step(q, k, v, 8, 1, 0, scale)
    torch.testing.assert_close(out, oracle(q[:, :, :8], k[:, :, :8], v[:, :, :8], None, scale)[:, :, 6:])


def test_overflow_on_first_step():
    q, k, v = make_qkv(9, seed=24)
    caches = ReferenceCaches(config_for(max_capacity=8, max_write=8), [0])
    with caches.activate(), pytest.raises(CacheOverflowError, match="capacity of 8"):
        step(q, k, v, 0, 9, 0, 0.25)
    assert caches.committed_length == 0


def test_no_active_cache():
    q, k, v = make_qkv(3)
    with pytest.raises(OffgraphError, match="no active reference cache"):
        step(q, k, v, 0, 3, 0, 0.25)
    # Leaving an activation restores "none active".
    with ReferenceCaches(config_for(), [0]).activate():
        step(q, k, v, 0, 3, 0, 0.25)
    with pytest.raises(OffgraphError, match="no active reference cache"):
        step(q, k, v, 0, 3, 0, 0.25)


def test_layer_missing_from_active_set():
    q, k, v = make_qkv(3)
    with ReferenceCaches(config_for(), [0, 1]).activate():
        with pytest.raises(OffgraphError, match=r"no reference cache for layer 5"):
            step(q, k, v, 0, 3, 5, 0.25)


@pytest.mark.parametrize(
    ("history", "positions"),
    [
        (0, [1, 2]),  # a fresh cache must start at 0
        (4, [5, 6]),  # gap
        (4, [3, 4]),  # overlap with the history
        (4, [4, 6]),  # gap inside the step
        (4, [5, 4]),  # out of order
        (4, [4, 4]),  # repeated
    ],
)
def test_non_contiguous_positions_rejected(history, positions):
    q, k, v = make_qkv(history + len(positions), seed=25)
    caches = ReferenceCaches(config_for(), [0])
    with caches.activate():
        if history:
            step(q, k, v, 0, history, 0, 0.25)
        w = len(positions)
        sl = slice(history, history + w)
        with pytest.raises(OffgraphError, match="positions must continue the history"):
            OP(q[:, :, sl], k[:, :, sl], v[:, :, sl], torch.tensor(positions), 0, 0.25, q.dtype)
        assert caches.committed_length == history
        # The right positions still work afterwards.
        out = step(q, k, v, history, w, 0, 0.25)
    expected = oracle(q, k, v, None, 0.25)[:, :, history:]
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize(
    "position",
    [
        torch.arange(3, dtype=torch.int32),
        torch.arange(4),
        torch.arange(3)[:, None].expand(3, 2),
        torch.arange(3)[None, :],
    ],
    ids=["int32", "wrong-length", "two-columns", "row"],
)
def test_bad_position_shape_or_dtype(position):
    q, k, v = make_qkv(3)
    with ReferenceCaches(config_for(), [0]).activate():
        with pytest.raises(OffgraphError, match="position must"):
            OP(q, k, v, position, 0, 0.25, q.dtype)


# --- the example model: step by step equals one full prefill ---------------------------------


def _run_model(bundle, tokens, chunks):
    caches = ReferenceCaches(bundle.cache_config, range(len(bundle.model.layers)))
    outs = []
    start = 0
    with caches.activate(), torch.no_grad():
        for width in chunks:
            outs.append(bundle.model(*bundle.make_inputs(tokens[:, start : start + width], start)))
            start += width
    assert caches.committed_length == tokens.shape[1]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("ring_window", [None, "default"], ids=["all-flat", "ring"])
def test_example_model_step_by_step_matches_full_prefill(ring_window):
    kwargs = {} if ring_window == "default" else {"ring_window": ring_window}
    bundle = load_bundle(f"{EXAMPLE}:build", **kwargs)
    if ring_window == "default":
        assert bundle.cache_config.ring_windows, "the default example has a ring layer"
    window = max(bundle.cache_config.ring_windows.values(), default=16)
    chunks = [5, 2, 11, 3, 1, 9] + [1] * 12  # prefill chunks, then decode
    n = sum(chunks)
    assert n > 2 * window  # the ring wraps
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, bundle.vocab_size, (1, n), generator=g)

    stepped = _run_model(bundle, tokens, chunks)
    full = _run_model(bundle, tokens, [n])
    assert stepped.shape == full.shape == (1, n, bundle.vocab_size)
    torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)


def test_example_ring_and_flat_differ_past_the_window():
    """Sanity: the ring config really changes the model once the history outgrows the window."""
    flat = load_bundle(f"{EXAMPLE}:build", ring_window=None)
    ring = load_bundle(f"{EXAMPLE}:build", ring_window=4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (1, 12), generator=g)
    a = _run_model(flat, tokens, [12])
    b = _run_model(ring, tokens, [12])
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:], atol=1e-3)


# --- what the reference keeps: rows as the storage holds them, nothing on a failed step ----------


def test_rows_are_kept_in_the_storage_dtype():
    """float32 q/k/v over bf16 storage: the oracle attends over the bf16-rounded rows, as the
    runtime's storage does (it kept them in float32 and so disagreed with any compiled step)."""
    q, k, v = make_qkv(12, seed=4)
    config = config_for().with_overrides(storage_dtype="bfloat16")
    caches = ReferenceCaches(config, [0])
    scale = 0.25
    with caches.activate():
        out = step(q, k, v, 0, 12, 0, scale)
    expected = oracle(q, k.bfloat16().float(), v.bfloat16().float(), None, scale)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert caches[0].keys.dtype == torch.bfloat16


def test_a_refused_step_leaves_the_history_and_the_callers_tensors_are_copied():
    q, k, v = make_qkv(6, hq=4, hkv=2, seed=5)
    caches = ReferenceCaches(config_for(), [0])
    with caches.activate():
        step(q, k, v, 0, 3, 0, 0.25)
        bad_q = torch.randn(1, 3, 3, 16)  # 3 query heads over 2 KV heads
        with pytest.raises(OffgraphError, match="query heads a multiple"):
            OP(bad_q, k[:, :, 3:], v[:, :, 3:], torch.arange(3, 6), 0, 0.25, q.dtype)
        assert caches.committed_length == 3 and caches[0].keys.shape[2] == 3
        k_step = k[:, :, 3:].clone()
        out = OP(q[:, :, 3:], k_step, v[:, :, 3:], torch.arange(3, 6), 0, 0.25, q.dtype)
        k_step.fill_(1e4)  # the caller reuses its buffer: the history must not change with it
        torch.testing.assert_close(caches[0].keys, k.float())
    torch.testing.assert_close(out, oracle(q, k, v, None, 0.25)[:, :, 3:], **TOL[torch.float32])
