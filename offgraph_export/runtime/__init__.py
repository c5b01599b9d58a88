"""The reference runtime: load an artifact, own the cache per session, run prepare -> run -> commit."""

from offgraph_export.runtime.admission import admit_step
from offgraph_export.runtime.artifact import Artifact
from offgraph_export.runtime.session import Session, SessionMetrics
from offgraph_export.runtime.storage import SessionStorage, default_allocator, grown_capacity

__all__ = [
    "Artifact",
    "Session",
    "SessionMetrics",
    "SessionStorage",
    "admit_step",
    "default_allocator",
    "grown_capacity",
]
