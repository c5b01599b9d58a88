"""Validation of the neutral-op sites before any rewrite."""

import pytest
import torch

from offgraph_export.errors import ExportError
from offgraph_export.passes.validate import validate_kv_sites
from tests import tiny_models as tm

X = (torch.randn(1, 5, 32), torch.arange(5))


def test_valid_graph_returns_one_site_per_layer():
    ep = tm.export(tm.Stack(3), X, (1, 0))
    code = ep.graph_module.code
    result = validate_kv_sites(ep)
    assert result.program is ep and not result.modified and ep.graph_module.code == code
    sites = result.produced
    assert [s.layer_id for s in sites] == [0, 1, 2]
    assert all(s.node.target.name() == "offgraph::update_and_attend" for s in sites)


def test_duplicate_layer_id_rejected():
    with pytest.raises(ExportError, match="layer_id 0 already used"):
        validate_kv_sites(tm.export(tm.SameLayerTwice(), X, (1, 0)))


def test_query_heads_not_multiple_of_kv_heads_rejected():
    with pytest.raises(ExportError, match="query heads 3 are not a multiple of KV heads 2"):
        validate_kv_sites(tm.export(tm.BadHeads(), X, (1, 0)))


def test_position_of_wrong_rank_rejected():
    class Rank3Position(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = tm.Attn(0)

        def forward(self, x, position):
            return self.a(x, position)

    ep = tm.export(Rank3Position(), (torch.randn(1, 5, 32), torch.arange(5).view(5, 1, 1)), (1, 0))
    with pytest.raises(ExportError, match=r"position must be \[T\] or \[T, 1\]"):
        validate_kv_sites(ep)


def test_position_t1_accepted():
    ep = tm.export(tm.Stack(1), (torch.randn(1, 5, 32), torch.arange(5).view(5, 1)), (1, 0))
    assert len(validate_kv_sites(ep).produced) == 1


def test_graph_without_op_rejected():
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ExportError, match="no offgraph::update_and_attend"):
        validate_kv_sites(ep)


@pytest.mark.parametrize("scale", [True, float("nan"), float("inf")])
def test_scale_that_is_not_a_finite_float_rejected(scale):
    """A graph (hand-edited, or from another producer of the op) whose scale is a bool or not
    finite: each would reach the kernels as a multiplier of every score."""
    ep = tm.export(tm.Stack(1), X, (1, 0))
    (node,) = [n for n in ep.graph.nodes if n.op == "call_function" and "update_and_attend" in str(n.target)]
    node.args = (*node.args[:5], scale, *node.args[6:])
    with pytest.raises(ExportError, match=r"scale must be a finite constant float, got (True|nan|inf)"):
        validate_kv_sites(ep)
