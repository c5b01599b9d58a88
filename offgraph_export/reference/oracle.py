"""The eager oracle a check compares compiled steps against.

An oracle runs the same model, step by step, with its own cache, and can show the K/V it holds for
a layer. :class:`ReferenceOracle` is the model written against the neutral op, run eagerly over
:class:`~offgraph_export.reference.cache.ReferenceCaches`; a frontend may bring its own (the
transformers frontend runs transformers' own attention and cache).
"""

from __future__ import annotations

from typing import Protocol

import torch

from offgraph_export.reference.cache import ReferenceCaches
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import CacheManifest

__all__ = ["Oracle", "HeldRows", "ReferenceOracle"]

#: ``(positions, keys [B,Hkv,n,D], values [B,Hkv,n,Dv])``: the K/V rows a layer holds, by position.
HeldRows = tuple[list[int], torch.Tensor, torch.Tensor]


class Oracle(Protocol):
    """What ``check`` needs of an oracle (a bundle's ``oracle(manifest)`` may make its own). An
    oracle may also set ``caches_other_form = True`` when its cache holds another form than the
    K/V the attention receives (transformers' multi-head latent attention caches its compressed
    latent): ``check`` then compares outputs, not stored rows, for the layers whose shapes show it
    (absent: False)."""

    def step(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Run one step eagerly (its cache advances); return the model's outputs."""
        ...

    def held(self, layer_id: int) -> HeldRows | None:
        """The K/V rows the oracle's cache holds for ``layer_id`` (None: it wrote none yet)."""
        ...


class ReferenceOracle:
    """``model`` (attention through the neutral op) over reference caches built from the manifest."""

    caches_other_form = False  # reference caches hold exactly what the neutral op receives

    def __init__(self, model: torch.nn.Module, manifest: CacheManifest) -> None:
        self.model = model
        self.caches = ReferenceCaches(CacheConfig.of_manifest(manifest), manifest.layer_ids)

    def step(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        with self.caches.activate():
            out = self.model(*inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def held(self, layer_id: int) -> HeldRows | None:
        cache = self.caches[layer_id]
        if cache.keys is None or cache.values is None or cache.positions is None:
            return None
        return cache.positions.tolist(), cache.keys, cache.values
