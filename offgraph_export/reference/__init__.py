"""Eager reference caches and the oracle the compiled steps are checked against."""

from offgraph_export.reference.cache import (
    ReferenceCaches,
    ReferenceLayerCache,
    active_caches,
    attend_by_position,
    normalize_position,
)
from offgraph_export.reference.oracle import HeldRows, Oracle, ReferenceOracle

__all__ = [
    "HeldRows",
    "Oracle",
    "ReferenceOracle",
    "ReferenceCaches",
    "ReferenceLayerCache",
    "active_caches",
    "attend_by_position",
    "normalize_position",
]
