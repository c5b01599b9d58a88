"""Build the cache manifest from the graph's KV op sites and the user's cache configuration.

The graph knows the shapes (batch, KV heads, head dims); the user knows the policies and
capacities. The manifest joins them and fixes where the storage inputs go: after the model's own
inputs, K then V per layer, in order of appearance in the graph.
"""

from __future__ import annotations

from torch.export import ExportedProgram

from offgraph_export.errors import ExportError, SpecError
from offgraph_export.passes.graph_utils import user_input_nodes
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.passes.result import PassResult
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import (
    MANIFEST_VERSION,
    PAGED_MANIFEST_VERSION,
    CacheManifest,
    storage_index,
    storage_names,
)

__all__ = ["build_manifest"]


def _static(value: object, what: str, node: str) -> int:
    if not isinstance(value, int):
        raise ExportError(f"{node}: {what} must be static, got symbolic {value}")
    return value


def build_manifest(ep: ExportedProgram, config: CacheConfig) -> PassResult[CacheManifest]:
    """Produce the manifest (the graph is left alone). Expects sites that
    :func:`~offgraph_export.passes.validate.validate_kv_sites` accepted."""
    sites = find_kv_sites(ep.graph)
    if not sites:
        raise ExportError("no KV op in the graph: there is no cache to describe")
    unknown = sorted(set(config.ring_windows) - {s.layer_id for s in sites})
    if unknown:
        raise ExportError(f"cache config names ring layers {unknown} that the graph does not have")
    first = len(user_input_nodes(ep))
    layers = []
    batch_sizes = set()
    for i, site in enumerate(sites):
        k, v = site.val("k"), site.val("v")
        node = site.node.name
        batch_sizes.add(_static(k.shape[0], "batch size", node))
        k_name, v_name = storage_names(site.layer_id)
        layers.append(
            dict(
                layer_id=site.layer_id,
                window=config.window(site.layer_id),
                kv_heads=_static(k.shape[1], "KV heads", node),
                head_dim=_static(k.shape[3], "head dim", node),
                v_head_dim=_static(v.shape[3], "value head dim", node),
                k=dict(name=k_name, index=storage_index(first, i, "k")),
                v=dict(name=v_name, index=storage_index(first, i, "v")),
            )
        )
    if len(batch_sizes) != 1:
        raise ExportError(f"KV ops disagree on batch size: {sorted(batch_sizes)}")
    paging = config.paging(storage_index(first, len(sites), "k"))
    if paging is not None and batch_sizes != {1}:
        raise ExportError(f"a batched artifact packs sessions along the tokens: the model's batch must be 1, got {sorted(batch_sizes)}")
    try:
        manifest = CacheManifest(
            version=MANIFEST_VERSION if paging is None else PAGED_MANIFEST_VERSION,
            paging=paging,
            storage_dtype=config.storage_dtype,
            batch_size=batch_sizes.pop(),
            max_capacity=config.max_capacity,
            initial_capacity=config.initial_capacity,
            max_write=config.max_write,
            layers=layers,
        )
    except ValueError as exc:
        raise SpecError(f"cannot build a valid manifest: {exc}") from exc
    return PassResult(ep, modified=False, produced=manifest)

