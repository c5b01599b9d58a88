"""Record which program input carries the step's positions.

Positions decide which storage rows a step writes and which it reads; a position that skips
ahead, rewinds or is negative would write and read the wrong rows, and every later step would
attend over garbage. So the runtime owns them: it checks (host tensors) or makes (device tensors)
them from its committed length. For that it must know which input they are: every cache op's
``position`` argument is followed back, through shape-only ops, to one user input. A model whose
positions are computed inside the graph produces None, and the runtime cannot own them.
"""

from __future__ import annotations

from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.passes.result import PassResult
from offgraph_export.passes.value_flow import source_user_input

__all__ = ["record_positions"]


def record_positions(ep: ExportedProgram) -> PassResult[int | None]:
    """Produce the index of the positions input, or None when the positions are computed in the
    graph; the graph is left alone. Raises :class:`ExportError` when cache ops take their
    positions from different inputs."""
    sources = {site.node.name: source_user_input(ep, site.position) for site in find_kv_sites(ep.graph)}
    found = set(sources.values())
    if len(found) > 1:
        listing = ", ".join(f"{name} from input {src}" for name, src in sources.items())
        raise ExportError(f"KV ops take their positions from different inputs: {listing}")
    return PassResult(ep, modified=False, produced=found.pop() if found else None)
