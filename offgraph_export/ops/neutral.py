"""The neutral KV op ``offgraph::update_and_attend``.

Models call it where attention meets the cache. To the tracer it is a functional op (no mutated
args; a fake impl gives the output shape), so ``torch.export`` keeps one node per layer for the
passes to strip. Eagerly it appends this step's k/v to the active reference cache of its layer and
attends q over the history, so the same model is its own oracle.
"""

from __future__ import annotations

import torch

from offgraph_export.reference.cache import active_caches

__all__ = ["update_and_attend", "NEUTRAL_OP_NAMES"]

# Qualified names of ops the strip pass accepts; ExecuTorch defines the same schema as kvcache::.
NEUTRAL_OP_NAMES = ("offgraph::update_and_attend", "kvcache::update_and_attend")


@torch.library.custom_op("offgraph::update_and_attend", mutates_args=())
def update_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    layer_id: int,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """q ``[B,Hq,T,D]``, k ``[B,Hkv,T,D]``, v ``[B,Hkv,T,Dv]``, position ``[T]`` or ``[T,1]`` int64
    -> ``[B,Hq,T,Dv]`` in ``out_dtype``."""
    return active_caches()[layer_id].update_and_attend(q, k, v, position, scale, out_dtype)


@update_and_attend.register_fake
def _update_and_attend_fake(q, k, v, position, layer_id, scale, out_dtype):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be BHSD")
    b, hq, t, _ = q.shape
    # Tie the extents together so export sees one token-width symbol for q, k, v and position.
    torch._check(k.shape[2] == t, lambda: "k must have as many tokens as q")
    torch._check(v.shape[2] == t, lambda: "v must have as many tokens as q")
    torch._check(position.shape[0] == t, lambda: "position must have one entry per token")
    return q.new_empty((b, hq, t, v.shape[-1]), dtype=out_dtype)
