"""Sibling projections fused into one GEMM: which linears are grouped, that the rewritten program
computes exactly what the unfused one does (eager, and compiled through the whole pipeline), and
that a graph with nothing to fuse is left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offgraph_export.frontends import load_bundle
from offgraph_export.passes.fuse_projections import fuse_projections
from offgraph_export.pipeline import export_model
from offgraph_export.reference import ReferenceCaches
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm
from tests.conftest import EXAMPLE

_aten = torch.ops.aten


def _linears(ep) -> list:
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target == _aten.linear.default]


def _eager(ep, config, layer_ids, steps) -> torch.Tensor:
    module = ep.module()
    caches = ReferenceCaches(config, layer_ids)
    with torch.no_grad(), caches.activate():
        return torch.cat([module(*inputs) for inputs in steps], dim=1)


def test_example_fuses_qkv_and_gate_up_per_layer_exactly():
    bundle = load_bundle(EXAMPLE)
    ep = export_model(bundle.model, bundle.example_inputs, bundle.token_dims, bundle.cache_config.max_write)
    result = fuse_projections(ep, bundle.example_inputs)
    assert result.modified and result.program is not ep
    assert result.produced == [
        ["layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight"],
        ["layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight"],
        ["layers.1.attention.wq.weight", "layers.1.attention.wk.weight", "layers.1.attention.wv.weight"],
        ["layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w3.weight"],
    ]
    assert len(_linears(ep)) == 2 * 7 + 1 and len(_linears(result.program)) == 2 * 4 + 1
    params = dict(result.program.named_parameters())
    assert not any(name in params for group in result.produced for name in group)  # originals gone
    fused = params["offgraph_fused_0_weight"]
    wq, wk, wv = (dict(ep.named_parameters())[n] for n in result.produced[0])
    assert torch.equal(fused, torch.cat([wq, wk, wv])) and not fused.requires_grad
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    steps = [bundle.make_inputs(tokens[:, a:b], a) for a, b in [(0, 9), (9, 10), (10, 23), (23, 24), (24, 30)]]
    config = bundle.cache_config
    torch.testing.assert_close(_eager(result.program, config, [0, 1], steps), _eager(ep, config, [0, 1], steps), atol=0, rtol=0)


def test_gqa_projections_with_another_value_head_dim():
    model = tm.Stack(2, hq=8, hkv=2, d=16, dv=8).eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0))
    result = fuse_projections(ep, inputs)
    assert [len(g) for g in result.produced] == [3, 3]
    assert dict(result.program.named_parameters())["offgraph_fused_0_weight"].shape == (8 * 16 + 2 * 16 + 2 * 8, 32)
    config = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16)
    xs = torch.randn(1, 12, 32)
    steps = [(xs[:, a:b], torch.arange(a, b)) for a, b in [(0, 5), (5, 6), (6, 12)]]
    torch.testing.assert_close(_eager(result.program, config, [0, 1], steps), _eager(ep, config, [0, 1], steps), atol=1e-6, rtol=1e-6)


class _Biased(nn.Module):
    """q/k/v with biases, then an MLP whose gate has a bias and up has none (not fusable)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = tm.Attn(0)
        for proj in (self.attn.q, self.attn.k, self.attn.v):
            proj.bias = nn.Parameter(torch.randn(proj.out_features))
        self.gate = nn.Linear(32, 64, bias=True)
        self.up = nn.Linear(32, 64, bias=False)

    def forward(self, x, position):
        h = x + self.attn(x, position)
        return self.gate(h) * self.up(h)


def test_biases_fused_with_their_weights_and_mixed_groups_left_alone():
    model = _Biased().eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0))
    result = fuse_projections(ep, inputs)
    assert result.produced == [["attn.q.weight", "attn.k.weight", "attn.v.weight"]]
    params = dict(result.program.named_parameters())
    assert "offgraph_fused_0_bias" in params and "gate.bias" in params and "attn.q.bias" not in params
    config = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16)
    xs = torch.randn(1, 9, 32)
    steps = [(xs[:, a:b], torch.arange(a, b)) for a, b in [(0, 4), (4, 5), (5, 9)]]
    torch.testing.assert_close(_eager(result.program, config, [0], steps), _eager(ep, config, [0], steps), atol=1e-6, rtol=1e-6)


class _WriteBetween(nn.Module):
    """``a`` reads h before an in-place write through a view of h, ``b`` and q/k/v after it: the
    traced graph keeps one node for h, so all five linears name the same input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = tm.Attn(0)
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)

    def forward(self, x, position):
        h = x * 1.0
        y1 = self.a(h)
        h[..., :8].mul_(2.0)
        y2 = self.b(h)
        return self.attn(h, position) + y1 + y2


def test_linears_on_both_sides_of_a_write_are_not_fused_together():
    model = _WriteBetween().eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0))
    h = _linears(ep)[0].args[0]
    assert sum(n.args[0] is h for n in _linears(ep)) == 5  # one input node for all five
    result = fuse_projections(ep, inputs)
    assert result.produced == [["b.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight"]]
    config = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16)
    xs = torch.randn(1, 9, 32)
    steps = [(xs[:, a:b], torch.arange(a, b)) for a, b in [(0, 4), (4, 5), (5, 9)]]
    torch.testing.assert_close(_eager(result.program, config, [0], steps), _eager(ep, config, [0], steps), atol=0, rtol=0)


class _BroadcastBias(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = tm.Attn(0)
        self.a, self.b = nn.Parameter(torch.randn(8, 32)), nn.Parameter(torch.randn(8, 32))
        self.bias_a, self.bias_b = nn.Parameter(torch.randn(1)), nn.Parameter(torch.randn(1))

    def forward(self, x, position):
        linear = torch.nn.functional.linear
        return self.attn(x * 1.0, position)[..., :8] + linear(x, self.a, self.bias_a) + linear(x, self.b, self.bias_b)


def test_siblings_with_broadcasting_biases_are_left_unfused():
    """A bias of shape (1,) broadcasts in eager; concatenated it would not: the group is skipped
    (it made the re-trace fail, so a valid model did not export)."""
    model = _BroadcastBias().eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    result = fuse_projections(tm.export(model, inputs, (1, 0)), inputs)
    assert result.produced == [["attn.q.weight", "attn.k.weight", "attn.v.weight"]]
    assert {"a", "b", "bias_a", "bias_b"} <= dict(result.program.named_parameters()).keys()


class _SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = tm.Attn(0)
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x, position):
        y = self.attn(x, position)
        return self.proj(y) + self.proj(y)  # the same weight twice on the same input


def test_nothing_to_fuse_leaves_the_program_alone():
    model = _SharedWeight().eval()
    inputs = (torch.randn(1, 5, 32), torch.arange(5))
    ep = tm.export(model, inputs, (1, 0))
    ep_stack = tm.export(tm.Stack(1, hq=4, hkv=2), inputs, (1, 0))
    result = fuse_projections(ep, inputs)
    assert result.produced == [["attn.q.weight", "attn.k.weight", "attn.v.weight"]]  # not proj twice
    lone = nn.Linear(32, 32)
    plain = torch.export.export(lone, (torch.randn(2, 32),))
    untouched = fuse_projections(plain, (torch.randn(2, 32),))
    assert untouched.program is plain and not untouched.modified and untouched.produced == []
    assert fuse_projections(ep_stack, inputs).modified


@pytest.mark.slow
def test_fused_example_compiles_and_passes_the_check(tmp_path, example_bundle):
    """Through the whole pipeline: the fused program lowers with AOTInductor and the spec check
    against the unfused eager model passes."""
    from offgraph_export.check import check_artifact
    from offgraph_export.pipeline import export_and_lower

    path, program, _ = export_and_lower(example_bundle, tmp_path / "fused.pt2")
    assert program.pass_results["fuse_projections"].modified
    assert program.options == {"fuse_projections": True}
    report = check_artifact(path, load_bundle(EXAMPLE), decode_steps=4)
    assert report.passed, report.render()
