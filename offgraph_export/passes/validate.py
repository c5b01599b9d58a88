"""Validate the neutral-op sites of a traced graph before anything is rewritten.

Every later stage assumes: layer ids are constant and unique, positions are ``[T]`` or ``[T, 1]``
int64, q/k/v agree on batch, width and head dims (``Hq`` a multiple of ``Hkv``), and the optional
``softcap`` is a positive constant and ``sinks`` an ``[Hq]`` tensor. Catching these
here gives a message naming the node instead of a shape error deep inside lowering. The sites are
validated once, by this pass; whether they agree with a given manifest is the strip pass's check
(the only pass that takes a manifest it did not build).
"""

from __future__ import annotations

import math

import torch
from torch.export import ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.passes.kv_sites import KvSite, find_kv_sites, same_size
from offgraph_export.passes.result import PassResult
from offgraph_export.reference.cache import sinks_problem, softcap_problem

__all__ = ["validate_kv_sites"]


def validate_kv_sites(ep: ExportedProgram) -> PassResult[list[KvSite]]:
    """Produce the sites (the graph is left alone), or raise :class:`ExportError` listing every
    problem found."""
    sites = find_kv_sites(ep.graph)
    problems: list[str] = []
    if not sites:
        raise ExportError(
            "the graph has no offgraph::update_and_attend (or kvcache::update_and_attend) node; "
            "does the model's attention call offgraph_export.ops.update_and_attend?"
        )
    seen: dict[int, str] = {}
    for site in sites:
        name = site.node.name
        if not isinstance(site.layer_id, int) or isinstance(site.layer_id, bool):
            problems.append(f"{name}: layer_id must be a constant int, got {site.layer_id!r}")
            continue
        if site.layer_id in seen:
            problems.append(f"{name}: layer_id {site.layer_id} already used by {seen[site.layer_id]}")
        seen[site.layer_id] = name
        if (not isinstance(site.scale, (int, float)) or isinstance(site.scale, bool)
                or not math.isfinite(site.scale)):
            problems.append(f"{name}: scale must be a finite constant float, got {site.scale!r}")
        q, k, v, pos = (site.val(n) for n in ("q", "k", "v", "position"))
        problem = softcap_problem(site.softcap) or (
            sinks_problem(site.val("sinks"), q.shape[1]) if site.sinks is not None else None
        )
        if problem:
            problems.append(f"{name}: {problem}")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            problems.append(
                f"{name}: q, k, v must be rank-4 BHSD, got ranks {q.dim()}, {k.dim()}, {v.dim()}"
            )
            continue
        if pos.dtype != torch.int64:
            problems.append(f"{name}: position must be int64, got {pos.dtype}")
        if not (pos.dim() == 1 or (pos.dim() == 2 and same_size(pos.shape[1], 1))):
            problems.append(f"{name}: position must be [T] or [T, 1], got shape {tuple(pos.shape)}")
        elif not same_size(pos.shape[0], k.shape[2]):
            problems.append(f"{name}: position has {pos.shape[0]} rows but k writes {k.shape[2]} tokens")
        if not (same_size(q.shape[0], k.shape[0]) and same_size(k.shape[0], v.shape[0])):
            problems.append(f"{name}: batch differs: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
        if not (same_size(q.shape[2], k.shape[2]) and same_size(k.shape[2], v.shape[2])):
            problems.append(f"{name}: token width differs: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}")
        if not same_size(q.shape[3], k.shape[3]):
            problems.append(f"{name}: head dim differs: q {q.shape[3]}, k {k.shape[3]}")
        if not same_size(k.shape[1], v.shape[1]):
            problems.append(f"{name}: KV heads differ: k {k.shape[1]}, v {v.shape[1]}")
        if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
            problems.append(f"{name}: query heads {q.shape[1]} are not a multiple of KV heads {k.shape[1]}")
    if problems:
        raise ExportError("invalid KV op sites:\n  " + "\n  ".join(problems))
    return PassResult(ep, modified=False, produced=sites)
