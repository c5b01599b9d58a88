"""An oracle for models written against ExecuTorch's ``kvcache::update_and_attend``: the model run
eagerly over ExecuTorch's own ``ContiguousReferenceCache`` (installed in its cache registry), so a
``check`` of such a model compares against an implementation this project did not write.

ExecuTorch's reference cache keeps one head dim for K and V and every position of every layer
(rings mask by window instead of dropping rows); it exposes the history only through
``update_and_fetch``, so :meth:`ExecuTorchCacheOracle.held` reads its per-layer tensors directly.
"""

from __future__ import annotations

import itertools

import torch

from offgraph_export.errors import OffgraphError
from offgraph_export.reference.oracle import HeldRows
from offgraph_export.specs.manifest import CacheManifest

__all__ = ["ExecuTorchCacheOracle"]

_KEYS = itertools.count()


class ExecuTorchCacheOracle:
    def __init__(self, model: torch.nn.Module, manifest: CacheManifest) -> None:
        try:
            from executorch.extension.llm.cache import reference_cache as rc
            from executorch.extension.llm.cache.update_and_attend import REGISTRY
        except ImportError as exc:
            raise OffgraphError(f"this model's oracle needs executorch (pip install 'offgraph-export[executorch]'): {exc}") from exc
        shapes = {(l.kv_heads, l.head_dim, l.v_head_dim) for l in manifest.layers}
        if len(shapes) != 1 or next(iter(shapes))[1] != next(iter(shapes))[2]:
            raise OffgraphError(
                f"ExecuTorch's reference cache needs one (kv_heads, head_dim) for every layer and K/V of "
                f"equal head dims; the manifest has {sorted(shapes)}"
            )
        kv_heads, head_dim, _ = shapes.pop()
        n_layers = len(manifest.layers)
        if sorted(manifest.layer_ids) != list(range(n_layers)):  # it would build max(id) + 1 caches
            raise OffgraphError(
                f"ExecuTorch's reference cache numbers layers 0..n-1; the manifest has layer ids "
                f"{sorted(manifest.layer_ids)[:8]}{' ...' if n_layers > 8 else ''}"
            )
        windows = {l.layer_id: l.window for l in manifest.layers}
        policies = [
            rc.LayerPolicy.ring(windows[i]) if windows.get(i) else rc.LayerPolicy.flat() for i in range(n_layers)
        ]
        config = rc.CacheConfig(
            n_layers=n_layers, n_kv_heads=kv_heads, head_dim=head_dim, capacity=manifest.max_capacity,
            batch_size=manifest.batch_size, layers=policies,
        )
        self.model = model
        self.cache = rc.ContiguousReferenceCache(config)
        self.registry = REGISTRY
        self.key = f"offgraph-check-{next(_KEYS)}"
        REGISTRY.install(self.key, self.cache)

    def step(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        with self.registry.active(self.key):
            out = self.model(*inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def held(self, layer_id: int) -> HeldRows | None:
        used = self.cache.used(layer_id)
        if used == 0:
            return None
        keys = self.cache._k[layer_id][:, :, :used]
        values = self.cache._v[layer_id][:, :, :used]
        return list(range(used)), keys, values

    def __del__(self) -> None:
        registry = getattr(self, "registry", None)
        if registry is not None:
            registry.uninstall(self.key)
