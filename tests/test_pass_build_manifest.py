"""The manifest joins the graph's shapes with the user's cache configuration."""

import pytest
import torch

from offgraph_export.errors import ExportError, SpecError
from offgraph_export.passes.build_manifest import build_manifest
from offgraph_export.specs import CacheConfig, parse_manifest
from tests import tiny_models as tm


def test_manifest_from_graph_and_config():
    ep = tm.export(tm.Stack(3, hq=8, hkv=1, d=16, dv=8), (torch.randn(2, 5, 32), torch.arange(5)), (1, 0))
    config = CacheConfig(max_capacity=100, initial_capacity=10, max_write=8, storage_dtype="bfloat16", ring_windows={1: 6})
    result = build_manifest(ep, config)
    assert result.program is ep and not result.modified
    m = result.produced
    assert (m.batch_size, m.max_capacity, m.initial_capacity, m.max_write, m.storage_dtype) == (2, 100, 10, 8, "bfloat16")
    assert [(l.layer_id, l.policy, l.window) for l in m.layers] == [(0, "flat", None), (1, "ring", 6), (2, "flat", None)]
    assert all((l.kv_heads, l.head_dim, l.v_head_dim) == (1, 16, 8) for l in m.layers)
    # storage inputs follow the two model inputs: K then V per layer
    assert [(s.name, s.index) for s in m.storage_inputs()] == [
        ("k_cache_0", 2), ("v_cache_0", 3), ("k_cache_1", 4), ("v_cache_1", 5), ("k_cache_2", 6), ("v_cache_2", 7)
    ]
    assert m.layers[1].rows(capacity=10, max_write=8) == 6 + 8 - 1
    assert parse_manifest(m.to_json()) == m


def test_ring_layer_missing_from_graph_rejected():
    ep = tm.export(tm.Stack(2), (torch.randn(1, 5, 32), torch.arange(5)), (1, 0))
    with pytest.raises(ExportError, match=r"ring layers \[7\]"):
        build_manifest(ep, CacheConfig(ring_windows={7: 4}))


def test_manifest_invariants_surface_as_spec_error():
    ep = tm.export(tm.Stack(1), (torch.randn(1, 5, 32), torch.arange(5)), (1, 0))
    bad = CacheConfig.model_construct(max_capacity=8, initial_capacity=4, max_write=16, storage_dtype="float32", ring_windows={})
    with pytest.raises(SpecError, match="max_write=16"):
        build_manifest(ep, bad)
