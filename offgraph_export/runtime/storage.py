"""Per-session KV storage: allocation, geometric transactional growth, binding order, metrics.

Flat layers share one capacity (rows) that grows as ``min(max, max(required, 2 x current))``
from the manifest's initial capacity, or, when a caller knows how long the session will get
(``reserve``), to exactly that many rows at once. Growth is transactional: every new tensor is allocated
first, live rows are copied, and only then are the new tensors swapped in; if any allocation or
copy fails the session's storage is exactly what it was. Ring layers never move. Shapes, row
counts and which layer owns which input are the manifest's rules
(:mod:`offgraph_export.specs.manifest`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offgraph_export.errors import CacheOverflowError, OffgraphError
from offgraph_export.specs.manifest import CacheManifest, StorageInput, Which

__all__ = ["Allocator", "default_allocator", "SessionStorage", "grown_capacity", "check_disjoint"]

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def grown_capacity(current: int, required: int, maximum: int) -> int:
    """The growth rule: ``min(max, max(required, 2 x current))``."""
    return min(maximum, max(required, 2 * current))


def check_disjoint(tensors: list[torch.Tensor]) -> None:
    """Refuse storage tensors whose memory overlaps (an allocator that hands out one buffer twice,
    or views of one): the program writes every storage input in place, so one layer's rows would
    overwrite another's."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
        for i, t in enumerate(tensors) if t.numel()
    )
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            raise OffgraphError(
                f"allocator returned overlapping storage: tensors {min(i, j)} and {max(i, j)} share memory "
                "(each storage input needs memory of its own)"
            )


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
        #: changes whenever ``bound()`` returns other tensors (growth, release): what a captured
        #: CUDA graph checks instead of every tensor's address
        self.generation = 0
        self._inputs = manifest.storage_inputs()
        self._keys = [self._key(s) for s in self._inputs]
        self.tensors: dict[tuple[int, Which], torch.Tensor] = {
            key: self._allocate(s, self.capacity) for key, s in zip(self._keys, self._inputs)
        }
        self._bound = [self.tensors[key] for key in self._keys]
        check_disjoint(self._bound)

    def _key(self, storage: StorageInput) -> tuple[int, Which]:
        layer, which = self.manifest.owner(storage)
        return layer.layer_id, which

    def _grows(self, storage: StorageInput) -> bool:
        return self.manifest.owner(storage)[0].window is None

    def _allocate(self, storage: StorageInput, capacity: int) -> torch.Tensor:
        shape = self.manifest.storage_shape(storage, capacity)
        tensor = self.allocator(shape, self.dtype, self.device)
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise OffgraphError(
                f"allocator returned {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; "
                f"expected {shape} {self.dtype} on {self.device}"
            )
        if not tensor.is_contiguous():  # the compiled step indexes storage as contiguous
            raise OffgraphError(
                f"allocator returned a non-contiguous tensor (strides {tensor.stride()}) for {shape}"
            )
        if self.poison:
            tensor.fill_(float("nan"))
        return tensor

    def bound(self) -> list[torch.Tensor]:
        """Storage tensors in program-input order (what the compiled step is called with)."""
        return self._bound

    def ensure(self, required: int, committed_length: int) -> bool:
        """Make flat capacity >= ``required`` tokens, keeping rows ``[0, committed_length)``.
        Returns whether storage moved. Raises :class:`CacheOverflowError` past ``max_capacity``."""
        if not self.manifest.has_flat or required <= self.capacity:
            return False
        self._check_fits(required)
        self._move(grown_capacity(self.capacity, required, self.manifest.max_capacity), committed_length)
        return True

    def reserve(self, tokens: int, committed_length: int) -> bool:
        """Make flat capacity >= ``tokens``, growing to exactly ``tokens`` rows (no doubling), so
        that steps up to that length never move storage. Returns whether storage moved. Raises
        :class:`CacheOverflowError` past ``max_capacity``."""
        if not self.manifest.has_flat or tokens <= self.capacity:
            return False
        self._check_fits(tokens)
        self._move(tokens, committed_length)
        return True

    def _check_fits(self, tokens: int) -> None:
        if tokens > self.manifest.max_capacity:
            raise CacheOverflowError(
                f"{tokens} tokens exceed the session's max capacity of {self.manifest.max_capacity}"
            )

    def _move(self, new_capacity: int, committed_length: int) -> None:
        """Flat storage of ``new_capacity`` rows holding rows ``[0, committed_length)``, swapped in
        only after every tensor is allocated and copied (the allocator may raise anything)."""
        staged: dict[tuple[int, Which], torch.Tensor] = {}
        for key, storage in zip(self._keys, self._inputs):  # allocate and copy before touching state
            if not self._grows(storage):
                continue
            new = self._allocate(storage, new_capacity)
            new[:, :, :committed_length].copy_(self.tensors[key][:, :, :committed_length])
            staged[key] = new
        check_disjoint([staged.get(key, self.tensors[key]) for key in self._keys])
        self.tensors.update(staged)
        self._bound = [self.tensors[key] for key in self._keys]
        self.capacity = new_capacity
        self.growth_count += 1
        self.generation += 1

    def release(self) -> None:
        """Drop every storage tensor (the session is closing)."""
        self.tensors.clear()
        self._bound = []
        self.generation += 1

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def poison_from(self, committed_length: int) -> None:
        """Fill the rows no committed position holds with NaN (check mode): flat rows
        ``[committed_length, capacity)``, and every ring row when nothing is committed (a reset)."""
        for key, storage in zip(self._keys, self._inputs):
            if self._grows(storage):
                self.tensors[key][:, :, committed_length:].fill_(float("nan"))
            elif committed_length == 0:
                self.tensors[key].fill_(float("nan"))
