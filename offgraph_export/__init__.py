"""offgraph-export: export LLM decoders whose KV cache lives off the graph.

Importing the package loads only the error types (no torch, no op or pass registration). The API
lives in its modules: ``pipeline`` (export -> passes -> lowering), ``passes.*`` (each pass alone),
``runtime`` (artifact, sessions), ``check`` (the spec check), ``ops`` (the neutral op), ``specs``
(compile specs and the storage rules). The contract is docs/design.md.
"""

from offgraph_export.errors import (
    ArtifactError,
    CacheOverflowError,
    CheckFailed,
    ExportError,
    OffgraphError,
    SpecError,
    StepFailed,
    StepRefused,
)

__all__ = [
    "ArtifactError",
    "CacheOverflowError",
    "CheckFailed",
    "ExportError",
    "OffgraphError",
    "SpecError",
    "StepFailed",
    "StepRefused",
]
__version__ = "0.1.0"
