"""The neutral KV op (importing this module defines ``torch.ops.offgraph.update_and_attend``)."""

from offgraph_export.ops.neutral import NEUTRAL_OP_NAMES, update_and_attend

__all__ = ["NEUTRAL_OP_NAMES", "update_and_attend"]
