"""Strip the KV-cache op: replace every neutral-op node with lowered code over storage inputs.

Why a re-trace: the lowered step adds inputs (per layer a K and a V storage tensor, after the
model's own inputs) and mutates them in place. Rather than hand-editing placeholders, input specs,
mutation outputs and the shape environment, we rewrite the FX graph of ``ep.module()`` so each
neutral-op node calls the chosen step implementation on its layer's storage, then trace the result
once more with ``torch.export``. Export itself then declares the new user inputs, records the
in-place writes as user-input mutations and keeps the graph signature consistent; the flat layers'
row count becomes one dynamic dimension (``capacity``) shared by all flat layers.

A node's optional ``softcap`` (a constant) and ``sinks`` (a value of the graph: the model's
parameter, which stays a parameter of the stripped program) go to the step implementation as
keywords, and only where set, so a custom step written before them still serves models without
them. The batched (paged) steps implement neither: such a program is refused here, by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch.export import Dim, ExportedProgram

from offgraph_export.compat import dynamic_dim
from offgraph_export.errors import ExportError
from offgraph_export.kernels.step_impls import StepImpl, resolve_step_impl
from offgraph_export.passes.graph_utils import input_dynamic_shapes
from offgraph_export.passes.kv_sites import KvSite, find_kv_sites, same_size
from offgraph_export.passes.result import PassResult
from offgraph_export.specs.manifest import BATCH_INPUTS, CacheManifest, LayerManifest, PagingManifest

__all__ = ["strip_kv_cache"]


class _LayerStep:
    """Stands in for one neutral-op node: calls the step impl on the layer's bound storage."""

    def __init__(self, owner: "_StrippedModule", layer: LayerManifest) -> None:
        self.owner = owner
        self.layer = layer
        self.__name__ = f"offgraph_lowered_step_layer_{layer.layer_id}"

    def __call__(self, q, k, v, position, layer_id, scale, out_dtype, softcap=None, sinks=None):
        k_store, v_store = self.owner.bound[self.layer.layer_id]
        extras = _attention_extras(softcap, sinks)
        return self.owner.impl(
            q, k, v, position, k_store, v_store, *self.owner.batch, self.layer.window, float(scale), out_dtype,
            **extras,
        )


def _attention_extras(softcap: object, sinks: object) -> dict[str, object]:
    """The optional arguments a step implementation is given: only those set."""
    extras: dict[str, object] = {}
    if softcap is not None:
        extras["softcap"] = float(softcap)  # type: ignore[arg-type]
    if sinks is not None:
        extras["sinks"] = sinks
    return extras


def _refuse_paged_extras(sites: list[KvSite]) -> None:
    """The batched steps (``kernels/portable_paged.py``, ``kernels/paged_attend.py``) have neither
    soft-capping nor sinks: refuse such a model by name rather than drop them."""
    features = {
        "attention logit soft-capping": [s.layer_id for s in sites if s.softcap is not None],
        "attention sinks": [s.layer_id for s in sites if s.sinks is not None],
    }
    found = [f"{name} (layers {layers})" for name, layers in features.items() if layers]
    if found:
        raise ExportError(
            f"a batched export (--max-sessions) does not support {' or '.join(found)}; "
            "export without --max-sessions (one session per artifact)"
        )


class _StrippedModule(torch.nn.Module):
    """``forward(*model_inputs, *storage[, *batch_inputs])``: the original program with storage
    bound per layer (and, paged, the four batch inputs handed to every layer's step)."""

    def __init__(
        self, inner: torch.nn.Module, manifest: CacheManifest, n_inputs: int, impl: StepImpl
    ) -> None:
        super().__init__()
        self.inner = inner
        self.manifest = manifest
        self.n_inputs = n_inputs
        self.impl = impl
        self.bound: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.batch: tuple[torch.Tensor, ...] = ()

    @classmethod
    def named(cls, names: Sequence[str]) -> type["_StrippedModule"]:
        """A subclass whose ``forward`` signature lists ``names``: export names placeholders
        after the signature, so the storage inputs get their manifest names."""

        def forward(self, *args: torch.Tensor):
            return _StrippedModule.forward(self, *args)

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params = [inspect.Parameter(n, kind) for n in ["self", *names]]
        forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return type("StrippedProgram", (cls,), {"forward": forward})

    def forward(self, *args: torch.Tensor):
        storage = self.manifest.storage_inputs()
        by_index = {s.index: arg for s, arg in zip(storage, args[self.n_inputs :])}
        self.bound = {
            layer.layer_id: (by_index[layer.k.index], by_index[layer.v.index])
            for layer in self.manifest.layers
        }
        self.batch = tuple(args[self.n_inputs + len(storage) :])
        try:
            return self.inner(*args[: self.n_inputs])
        finally:
            self.bound, self.batch = {}, ()


def _check_manifest_matches_sites(sites: list[KvSite], manifest: CacheManifest) -> None:
    """The manifest describes exactly the graph's layers, with the graph's head counts and dims."""
    problems = []
    graph_layers = {site.layer_id for site in sites}
    missing = sorted(graph_layers - set(manifest.layer_ids))  # type: ignore[type-var]
    extra = sorted(set(manifest.layer_ids) - graph_layers)
    if missing:
        problems.append(f"layers {missing} are in the graph but not in the manifest")
    if extra:
        problems.append(f"layers {extra} are in the manifest but have no op in the graph")
    for site in sites:
        if site.layer_id not in manifest.layer_ids:
            continue
        layer = manifest.layer(site.layer_id)  # type: ignore[arg-type]
        k, v = site.val("k"), site.val("v")
        got = (k.shape[1], k.shape[3], v.shape[3])
        want = (layer.kv_heads, layer.head_dim, layer.v_head_dim)
        if not all(same_size(a, b) for a, b in zip(got, want)):
            problems.append(
                f"{site.node.name}: (kv_heads, head_dim, v_head_dim) is {got} in the graph but "
                f"{want} in the manifest for layer {site.layer_id}"
            )
    if problems:
        raise ExportError("the manifest does not match the graph:\n  " + "\n  ".join(problems))


def _example_capacity(manifest: CacheManifest, taken: set[int]) -> int:
    # Distinct from every other example extent, so export does not unify the capacity with them.
    cap = max(manifest.initial_capacity, 2)
    while cap in taken:
        cap += 1
    if cap > manifest.max_capacity:
        raise ExportError(
            f"cannot pick an example capacity <= max_capacity={manifest.max_capacity} distinct from "
            f"the example input extents {sorted(taken)}"
        )
    return cap


def _example_pages(paging: PagingManifest, taken: set[int]) -> int:
    """An example pool size distinct from every other example extent (as :func:`_example_capacity`)."""
    pages = 2
    while pages in taken:
        pages += 1
    if pages > paging.max_pool_pages:
        raise ExportError(f"cannot pick an example pool of at most {paging.max_pool_pages} pages distinct from {sorted(taken)}")
    return pages


def _example_batch(
    paging: PagingManifest | None, sites: list[KvSite], hints: dict[str, object], device: torch.device
) -> tuple[list[torch.Tensor], list[dict[int, object]]]:
    """Example batch inputs (every token a padding token: slot 0, page 0) and their dynamic
    shapes: the per-token inputs share the token width's hint."""
    if paging is None:
        return [], []
    width = sites[0].val("k").shape[2]
    if not isinstance(width, torch.SymInt) or str(width.node.expr) not in hints:
        raise ExportError("a batched program needs the token width to be a dynamic dim of the model's inputs")
    hint = hints[str(width.node.expr)]
    t = int(width.node.hint) if width.node.hint is not None else 2
    args, shapes = [], []
    for name in BATCH_INPUTS:
        shape = paging.input_shape(name, t)
        args.append(torch.zeros(shape, dtype=torch.int32, device=device))
        shapes.append({0: hint} if name in ("token_slots", "token_rows") else {})
    return args, shapes


def strip_kv_cache(
    ep: ExportedProgram,
    manifest: CacheManifest,
    example_inputs: Sequence[torch.Tensor],
    impl: str | StepImpl = "portable",
) -> PassResult[list[int]]:
    """Return a new program: the model's inputs then the manifest's storage inputs, with every
    neutral op replaced by in-place row writes and attention over valid rows (``impl``, see
    :mod:`offgraph_export.kernels.step_impls`). Produces the ids of the layers it stripped."""
    paging = manifest.paging
    step = resolve_step_impl(impl, paged=paging is not None)
    names = list(ep.graph_signature.user_inputs)
    if len(example_inputs) != len(names):
        raise ExportError(
            f"got {len(example_inputs)} example inputs but the program takes {len(names)} ({names})"
        )
    manifest.check_follows(len(names))
    gm = ep.module()
    sites = find_kv_sites(gm.graph)
    _check_manifest_matches_sites(sites, manifest)
    if paging is not None:
        _refuse_paged_extras(sites)
    batch_names = [i.name for i in paging.inputs] if paging is not None else []
    all_names = [*names, *(s.name for s in manifest.storage_inputs()), *batch_names]
    stripped = _StrippedModule.named(all_names)(gm, manifest, len(names), step)
    for site in sites:
        site.node.target = _LayerStep(stripped, manifest.layer(site.layer_id))  # type: ignore[arg-type]
    gm.recompile()

    taken = {int(s) for x in example_inputs for s in x.shape}
    capacity = _example_capacity(manifest, taken) if paging is None else _example_pages(paging, taken)
    dtype = getattr(torch, manifest.storage_dtype)
    device = example_inputs[0].device
    storage = manifest.storage_inputs()
    storage_args = [
        torch.zeros(manifest.storage_shape(s, capacity), dtype=dtype, device=device) for s in storage
    ]
    flat = [manifest.owner(s)[0].window is None for s in storage]
    hints: dict[str, object] = {}
    input_shapes = input_dynamic_shapes(ep, hints)
    batch_args, batch_shapes = _example_batch(paging, sites, hints, device)
    rows_dim = 2 if paging is None else 0  # the flat storage's growing dim: rows, or pages

    def trace(capacity_dim: Callable[[], object]) -> ExportedProgram:
        storage_shapes = [{rows_dim: capacity_dim()} if f else {} for f in flat]
        return torch.export.export(
            stripped,
            (*example_inputs, *storage_args, *batch_args),
            dynamic_shapes=(*input_shapes, *storage_shapes, *batch_shapes),
            strict=False,
        )

    top = manifest.max_capacity if paging is None else paging.max_pool_pages
    shared = Dim("capacity" if paging is None else "pages", min=2, max=top)
    try:
        try:
            # One named dimension shared by every flat layer: they grow together.
            new_ep = trace(lambda: shared)
        except torch._dynamo.exc.UserError as exc:
            if exc.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
                raise
            # The strict solver cannot prove some guards over a named range (see
            # compat.dynamic_dim); fall back to one range hint per flat storage input.
            new_ep = trace(lambda: dynamic_dim(2, top))
    except Exception as exc:  # export raises many types; re-raise as ours with the cause chained
        raise ExportError(f"re-tracing the stripped program failed: {exc}") from exc

    got = list(new_ep.graph_signature.user_inputs)
    if got != all_names:
        raise ExportError(f"stripped program inputs are {got}, expected {all_names}")
    left = find_kv_sites(new_ep.graph)
    if left:
        raise ExportError(f"KV op nodes survived the strip: {[s.node.name for s in left]}")
    return PassResult(new_ep, modified=True, produced=[int(s.layer_id) for s in sites])  # type: ignore[call-overload]
