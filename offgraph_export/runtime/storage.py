"""Per-session KV storage: allocation, geometric transactional growth, binding order, metrics.

Flat layers share one capacity (rows) that grows as ``min(max, max(required, 2 x current))``
from the manifest's initial capacity. Growth is transactional: every new tensor is allocated
first, live rows are copied, and only then are the new tensors swapped in; if any allocation or
copy fails the session's storage is exactly what it was. Ring layers are fixed at
``window + max_write - 1`` rows and never move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offgraph_export.errors import CacheOverflowError
from offgraph_export.specs.manifest import CacheManifest, LayerManifest

__all__ = ["Allocator", "default_allocator", "SessionStorage", "grown_capacity"]

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def grown_capacity(current: int, required: int, maximum: int) -> int:
    """The growth rule of DESIGN.md: ``min(max, max(required, 2 x current))``."""
    return min(maximum, max(required, 2 * current))


class SessionStorage:
    """K/V storage tensors of one session, in the program's storage-input order.

    ``poison`` fills unwritten rows with NaN (at allocation and growth), which the check uses to
    prove a step writes exactly the rows it should.
    """

    def __init__(
        self,
        manifest: CacheManifest,
        device: torch.device | str,
        allocator: Allocator = default_allocator,
        poison: bool = False,
    ) -> None:
        self.manifest = manifest
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, manifest.storage_dtype)
        self.allocator = allocator
        self.poison = poison
        self.capacity = manifest.initial_capacity if manifest.has_flat else 0
        self.growth_count = 0
        self._order = [(layer, which) for layer in manifest.layers for which in ("k", "v")]
        self._order.sort(key=lambda item: getattr(item[0], item[1]).index)
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        for layer, which in self._order:
            self.tensors[(layer.layer_id, which)] = self._allocate(layer, which, self._rows(layer, self.capacity))
        self._bound = [self.tensors[(layer.layer_id, which)] for layer, which in self._order]

    def _rows(self, layer: LayerManifest, capacity: int) -> int:
        return layer.rows(capacity, self.manifest.max_write)

    def _allocate(self, layer: LayerManifest, which: str, rows: int) -> torch.Tensor:
        dim = layer.head_dim if which == "k" else layer.v_head_dim
        shape = (self.manifest.batch_size, layer.kv_heads, rows, dim)
        tensor = self.allocator(shape, self.dtype, self.device)
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise RuntimeError(
                f"allocator returned {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; "
                f"expected {shape} {self.dtype} on {self.device}"
            )
        if not tensor.is_contiguous():  # the compiled step indexes storage as contiguous
            raise RuntimeError(
                f"allocator returned a non-contiguous tensor (strides {tensor.stride()}) for {shape}"
            )
        if self.poison:
            tensor.fill_(float("nan"))
        return tensor

    def bound(self) -> list[torch.Tensor]:
        """Storage tensors in program-input order (what the compiled step is called with)."""
        return self._bound

    def layer_tensors(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[(layer_id, "k")], self.tensors[(layer_id, "v")]

    def ensure(self, required: int, live: int) -> bool:
        """Make flat capacity >= ``required`` tokens, keeping rows ``[0, live)``. Returns whether
        storage moved. Raises :class:`CacheOverflowError` past ``max_capacity``."""
        if not self.manifest.has_flat or required <= self.capacity:
            return False
        maximum = self.manifest.max_capacity
        if required > maximum:
            raise CacheOverflowError(
                f"{required} tokens exceed the session's max capacity of {maximum}"
            )
        new_capacity = grown_capacity(self.capacity, required, maximum)
        staged: dict[tuple[int, str], torch.Tensor] = {}
        for layer, which in self._order:  # allocate and copy everything before touching state
            if layer.policy != "flat":
                continue
            new = self._allocate(layer, which, new_capacity)
            new[:, :, :live].copy_(self.tensors[(layer.layer_id, which)][:, :, :live])
            staged[(layer.layer_id, which)] = new
        self.tensors.update(staged)
        self._bound = [self.tensors[(layer.layer_id, which)] for layer, which in self._order]
        self.capacity = new_capacity
        self.growth_count += 1
        return True

    def release(self) -> None:
        """Drop every storage tensor (the session is closing)."""
        self.tensors.clear()
        self._bound = []

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def poison_from(self, live: int) -> None:
        """Fill flat rows ``[live, capacity)`` with NaN (check mode)."""
        for layer, which in self._order:
            if layer.policy == "flat":
                self.tensors[(layer.layer_id, which)][:, :, live:].fill_(float("nan"))
