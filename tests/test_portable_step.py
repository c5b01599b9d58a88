"""The portable lowered step eagerly, against a plain full recompute: every step writes into
NaN-poisoned storage of the manifest's row count (flat capacity, or a ring's ``ring_rows``), and
its output must equal causal (and windowed) attention over the whole sequence so far, computed
without storage, rows or positions. It is the reference the Triton kernels are tested against
(``tests/test_triton_attend.py``), so it has an oracle of its own here, not only compiled checks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from offgraph_export.kernels.portable import portable_update_and_attend
from offgraph_export.specs.manifest import ring_rows


def _full_recompute(q, k, v, window, scale):
    """softmax(q k^T) v over the whole sequence, causal, windowed, GQA by repetition; float64."""
    n, group = q.shape[2], q.shape[1] // k.shape[1]
    kf, vf = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    qp, kp = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= kp > qp - window
    scores = (q.double() @ kf.transpose(-1, -2)) * scale
    return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vf


@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize(("hq", "hkv", "dv"), [(4, 4, 8), (4, 2, 8), (6, 2, 5), (8, 1, 8)])
def test_portable_step_equals_a_full_recompute(window, hq, hkv, dv):
    rng = random.Random(hash((window, hq, hkv, dv)) & 0xFFFF)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    b, d, n, max_write = 2, 8, 30, 7
    q = torch.randn(b, hq, n, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, dv, generator=gen)
    rows = n if window is None else ring_rows(window, max_write)
    k_store = torch.full((b, hkv, rows, d), float("nan"))
    v_store = torch.full((b, hkv, rows, dv), float("nan"))
    scale = d**-0.5
    start = 0
    while start < n:
        width = min(rng.randint(1, max_write), n - start)
        position = torch.arange(start, start + width)
        if rng.random() < 0.5:
            position = position[:, None]  # [T, 1] is accepted too
        sl = slice(start, start + width)
        out = portable_update_and_attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], position, k_store, v_store,
                                         window, scale, torch.float32)
        want = _full_recompute(q[:, :, : start + width], k[:, :, : start + width], v[:, :, : start + width],
                               window, scale)[:, :, start:]
        assert torch.isfinite(out).all()  # poisoned rows never leak
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        start += width
