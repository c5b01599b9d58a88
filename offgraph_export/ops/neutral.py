"""The neutral KV op ``offgraph::update_and_attend``.

Models call it where attention meets the cache. To the tracer it is a functional op (no mutated
args; a fake impl gives the output shape), so ``torch.export`` keeps one node per layer for the
passes to strip. Eagerly it appends this step's k/v to the active reference cache of its layer and
attends q over the history, so the same model is its own oracle.

Two trailing arguments are optional and default to None, so a call (or a graph node) without them
is the op of ExecuTorch's ``kvcache::update_and_attend``, which lacks them: ``softcap`` (a
constant float: scores become ``tanh(scores / softcap) * softcap`` before masking, Gemma 2) and
``sinks`` (a ``[Hq]`` tensor, a model parameter: one extra logit per query head that joins every
row's softmax and whose probability is dropped, GPT-OSS). docs/design.md section 2 has the math.
"""

from __future__ import annotations

from typing import Optional

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
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q ``[B,Hq,T,D]``, k ``[B,Hkv,T,D]``, v ``[B,Hkv,T,Dv]``, position ``[T]`` or ``[T,1]`` int64
    -> ``[B,Hq,T,Dv]`` in ``out_dtype``; ``softcap`` None or a positive float, ``sinks`` None or
    ``[Hq]``."""
    return active_caches()[layer_id].update_and_attend(
        q, k, v, position, scale, out_dtype, softcap=softcap, sinks=sinks
    )


@update_and_attend.register_fake
def _update_and_attend_fake(q, k, v, position, layer_id, scale, out_dtype, softcap=None, sinks=None):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be BHSD")
    b, hq, t, _ = q.shape
    # Tie the extents together so export sees one token-width symbol for q, k, v and position.
    torch._check(k.shape[2] == t, lambda: "k must have as many tokens as q")
    torch._check(v.shape[2] == t, lambda: "v must have as many tokens as q")
    torch._check(position.shape[0] == t, lambda: "position must have one entry per token")
    if sinks is not None:
        torch._check(sinks.dim() == 1 and sinks.shape[0] == hq, lambda: "sinks must hold one logit per query head")
    return q.new_empty((b, hq, t, v.shape[-1]), dtype=out_dtype)
