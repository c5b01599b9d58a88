"""Compile specs shared by export, lowering and the runtime, and the storage rules they imply
(defined once, in :mod:`offgraph_export.specs.manifest`). Nothing here imports torch."""

from offgraph_export.specs.artifact import (
    ArtifactSpecs,
    InputSpec,
    SymbolRange,
    archive_entries,
    parse_artifact_specs,
    read_artifact_specs,
    write_artifact_specs,
)
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import (
    MANIFEST_KEY,
    MANIFEST_VERSION,
    CacheManifest,
    LayerManifest,
    StorageInput,
    parse_manifest,
    ring_rows,
    row_position,
    storage_index,
    storage_names,
    storage_row,
)
from offgraph_export.specs.step_width import (
    STEP_WIDTH_KEY,
    StepWidthSpec,
    format_step_width,
    parse_step_width,
)

__all__ = [
    "MANIFEST_KEY",
    "MANIFEST_VERSION",
    "STEP_WIDTH_KEY",
    "ArtifactSpecs",
    "CacheConfig",
    "CacheManifest",
    "InputSpec",
    "LayerManifest",
    "StepWidthSpec",
    "StorageInput",
    "SymbolRange",
    "archive_entries",
    "format_step_width",
    "parse_artifact_specs",
    "parse_manifest",
    "parse_step_width",
    "read_artifact_specs",
    "ring_rows",
    "row_position",
    "storage_index",
    "storage_names",
    "storage_row",
    "write_artifact_specs",
]
