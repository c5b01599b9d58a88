"""``record_positions`` and the value flow it follows (``value_flow.source_user_input``): which
input carries the positions, through the shape-only ops a model may put between that input and the
cache op; None when the positions are computed in the graph; refused when layers disagree; and a
position input of one entry broadcast to every token is not taken for per-token positions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offgraph_export.errors import ExportError
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.passes.record_positions import record_positions
from offgraph_export.passes.value_flow import source_user_input
from offgraph_export.pipeline import run_passes
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm

CONFIG = CacheConfig(max_capacity=64, initial_capacity=8, max_write=16)


class _Through(nn.Module):
    """Positions reach the op through ``shape_ops(position, x)``; a conditioning input comes first."""

    def __init__(self, shape_ops):
        super().__init__()
        self.attn, self.shape_ops = tm.Attn(0), shape_ops

    def forward(self, cond, x, position):
        return self.attn(x + cond, self.shape_ops(position, x))


class _Computed(nn.Module):
    """Positions made in the graph from a start offset: no input carries them."""

    def __init__(self):
        super().__init__()
        self.attn = tm.Attn(0)

    def forward(self, x, start):
        return self.attn(x, torch.arange(x.shape[1]) + start)


class _TwoSources(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = tm.Attn(0), tm.Attn(1)

    def forward(self, x, p, q):
        return self.b(self.a(x, p), q)


def _export(model, inputs, token_dims):
    return tm.export(model.eval(), inputs, token_dims)


@pytest.mark.parametrize("shape_ops", [
    lambda p, x: p,
    lambda p, x: p.view(-1, 1).reshape(-1),
    lambda p, x: p.unsqueeze(0).squeeze(0).clone(),
    lambda p, x: p.flatten().contiguous().detach(),
], ids=["direct", "view-reshape", "unsqueeze-squeeze-clone", "flatten-contiguous-detach"])
def test_the_positions_input_is_found_through_shape_only_ops(shape_ops):
    inputs = (torch.randn(1, 1, 32), torch.randn(1, 5, 32), torch.arange(5))
    ep = _export(_Through(shape_ops), inputs, (None, 1, 0))
    result = record_positions(ep)
    assert result.produced == 2 and not result.modified
    (site,) = find_kv_sites(ep.graph)
    assert source_user_input(ep, site.position) == 2


def test_positions_computed_in_the_graph_have_no_input():
    ep = _export(_Computed(), (torch.randn(1, 5, 32), torch.tensor(3)), (1, None))
    assert record_positions(ep).produced is None


def test_layers_reading_positions_from_different_inputs_are_refused():
    inputs = (torch.randn(1, 5, 32), torch.arange(5), torch.arange(5))
    ep = _export(_TwoSources(), inputs, (1, 0, 0))
    with pytest.raises(ExportError, match=r"positions from different inputs: .*from input 1.*from input 2"):
        record_positions(ep)


def test_one_position_broadcast_to_every_token_is_not_taken_for_per_token_positions():
    """``start.expand(T)`` repeats one value for every token: the runtime, which makes positions
    as ``arange(length, length + T)``, cannot own such an input, so it is not recorded as the
    positions input (the export then goes on with the positions left to the caller, as for
    positions computed in the graph)."""
    model = _Through(lambda p, x: p.expand(x.shape[1]))
    inputs = (torch.randn(1, 1, 32), torch.randn(1, 5, 32), torch.tensor([4]))
    ep = _export(model, inputs, (None, 1, None))
    assert record_positions(ep).produced is None
    # a size-1 expand that repeats nothing is still shape-only
    same = _export(_Through(lambda p, x: p.view(-1, 1).expand(-1, 1).reshape(-1)),
                   (torch.randn(1, 1, 32), torch.randn(1, 5, 32), torch.arange(5)), (None, 1, 0))
    assert record_positions(same).produced == 2


def test_the_pipeline_records_the_positions_input_in_the_specs():
    inputs = (torch.randn(1, 1, 32), torch.randn(1, 5, 32), torch.arange(5))
    ep = _export(_Through(lambda p, x: p.view(-1)), inputs, (None, 1, 0))
    program = run_passes(ep, inputs, CONFIG)
    assert program.pass_results["record_positions"].produced == 2
    assert program.positions_input == 2
