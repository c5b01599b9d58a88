"""Compile specs shared by export, lowering and the runtime. Nothing here imports torch."""

from offgraph_export.specs.artifact import (
    ArtifactSpecs,
    InputSpec,
    archive_entries,
    parse_artifact_specs,
    read_artifact_specs,
    write_artifact_specs,
)
from offgraph_export.specs.cache_config import CacheConfig
from offgraph_export.specs.manifest import (
    MANIFEST_KEY,
    MANIFEST_VERSION,
    STORAGE_DTYPES,
    CacheManifest,
    LayerManifest,
    StorageInput,
    parse_manifest,
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
    "STORAGE_DTYPES",
    "STEP_WIDTH_KEY",
    "ArtifactSpecs",
    "CacheConfig",
    "InputSpec",
    "archive_entries",
    "parse_artifact_specs",
    "read_artifact_specs",
    "write_artifact_specs",
    "CacheManifest",
    "LayerManifest",
    "StorageInput",
    "StepWidthSpec",
    "format_step_width",
    "parse_manifest",
    "parse_step_width",
]
