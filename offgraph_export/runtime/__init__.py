"""The reference runtime: load an artifact, own the cache per session, run prepare -> run -> commit."""

from offgraph_export.runtime.admission import admit_step
from offgraph_export.runtime.artifact import Artifact
from offgraph_export.runtime.session import Session, SessionMetrics
from offgraph_export.runtime.storage import SessionStorage, default_allocator, grown_capacity


def load_artifact(path, single_threaded: bool = False):
    """A ``.pt2`` (AOTInductor, :class:`Artifact`) or a ``.pte`` (ExecuTorch, ``PteArtifact``)."""
    if str(path).endswith(".pte"):
        from offgraph_export.runtime.pte_artifact import PteArtifact

        return PteArtifact.load(path, single_threaded=single_threaded)
    return Artifact.load(path, single_threaded=single_threaded)


def read_specs(path):
    """The specs of a ``.pt2`` or ``.pte`` artifact, without loading any of its code."""
    if str(path).endswith(".pte"):
        from offgraph_export.specs.pte import read_pte_specs

        return read_pte_specs(path)
    from offgraph_export.specs.artifact import read_artifact_specs

    return read_artifact_specs(path)

__all__ = [
    "Artifact",
    "Session",
    "SessionMetrics",
    "SessionStorage",
    "admit_step",
    "default_allocator",
    "grown_capacity",
    "load_artifact",
    "read_specs",
]
