"""offgraph-export: export LLM decoders whose KV cache lives off the graph.

The public API is re-exported lazily from the submodules so that importing the package
registers nothing and costs nothing; see ``offgraph_export.pipeline`` for the one-call path.
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
