"""Eager reference caches: the oracle the compiled steps are checked against."""

from offgraph_export.reference.cache import (
    ReferenceCaches,
    ReferenceLayerCache,
    active_caches,
    attend_by_position,
    normalize_position,
)

__all__ = [
    "ReferenceCaches",
    "ReferenceLayerCache",
    "active_caches",
    "attend_by_position",
    "normalize_position",
]
