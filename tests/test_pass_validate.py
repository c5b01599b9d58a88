"""Validation of the neutral-op sites before any rewrite."""

import pytest
import torch

from offgraph_export.errors import ExportError
from offgraph_export.passes.build_manifest import build_manifest
from offgraph_export.passes.validate import validate_kv_sites
from offgraph_export.specs import CacheConfig
from tests import tiny_models as tm

X = (torch.randn(1, 5, 32), torch.arange(5))


def test_valid_graph_returns_one_site_per_layer():
    sites = validate_kv_sites(tm.export(tm.Stack(3), X, (1, 0)))
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
    assert len(validate_kv_sites(ep)) == 1


def test_manifest_coverage_checked_both_ways():
    ep2 = tm.export(tm.Stack(2), X, (1, 0))
    ep3 = tm.export(tm.Stack(3), X, (1, 0))
    manifest2 = build_manifest(ep2, CacheConfig())
    with pytest.raises(ExportError, match=r"layers \[2\] are in the graph but not in the manifest"):
        validate_kv_sites(ep3, manifest2)
    manifest3 = build_manifest(ep3, CacheConfig())
    with pytest.raises(ExportError, match=r"layers \[2\] are in the manifest but have no op"):
        validate_kv_sites(ep2, manifest3)


def test_manifest_head_dims_checked():
    ep_small = tm.export(tm.Stack(1, d=16), X, (1, 0))
    ep_big = tm.export(tm.Stack(1, d=32, dv=32), X, (1, 0))
    with pytest.raises(ExportError, match="head_dim"):
        validate_kv_sites(ep_big, build_manifest(ep_small, CacheConfig()))


def test_graph_without_op_rejected():
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ExportError, match="no offgraph::update_and_attend"):
        validate_kv_sites(ep)
