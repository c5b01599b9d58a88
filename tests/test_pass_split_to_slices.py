"""``split_to_slices`` (run before ExecuTorch's CUDA backend, which has no split_copy kernel): every
split with static sizes becomes one slice per piece and computes the same values; a split it
cannot bound is left alone. The edge-dialect check is in test_executorch.py."""

from __future__ import annotations

import torch

from offgraph_export.passes.split_to_slices import split_to_slices


class _Splits(torch.nn.Module):
    def forward(self, x, empty):
        a, b, c = x.split(3, dim=-1)  # 3 + 3 + 1: a short last piece
        d, e = x.split_with_sizes([2, 5], dim=-1)
        f, g = x.chunk(2, dim=-2)  # along a negative, non-last dim
        (h,) = empty.split(2, dim=0)  # an empty dim: one empty piece, left as a split
        return a * 2, b, c + 1, d, e, f, g, h


def test_split_to_slices_rewrites_static_splits_and_keeps_values():
    args = (torch.randn(4, 6, 7), torch.randn(0, 3))
    ep = torch.export.export(_Splits(), args)
    want = ep.module()(*args)
    splits = [n for n in ep.graph.nodes if "split" in str(n.target) or "chunk" in str(n.target)]
    result = split_to_slices(ep)
    assert result.modified and result.produced == len(splits) - 1
    left = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("split" in t or "chunk" in t for t in left) == 1  # the empty one
    got = ep.module()(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    ep.validate()  # outputs that were split pieces are named in the signature by their slices


def test_split_to_slices_leaves_a_program_without_splits_alone():
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    assert not split_to_slices(ep).modified
