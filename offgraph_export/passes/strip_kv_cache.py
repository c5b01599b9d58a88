"""Strip the KV-cache op: replace every neutral-op node with lowered code over storage inputs.

Why a re-trace: the lowered step adds inputs (per layer a K and a V storage tensor, after the
model's own inputs) and mutates them in place. Rather than hand-editing placeholders, input specs,
mutation outputs and the shape environment, we rewrite the FX graph of ``ep.module()`` so each
neutral-op node calls the chosen step implementation on its layer's storage, then trace the result
once more with ``torch.export``. Export itself then declares the new user inputs, records the
in-place writes as user-input mutations and keeps the graph signature consistent; the flat layers'
row count becomes one dynamic dimension (``capacity``) shared by all flat layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch.export import Dim, ExportedProgram

from offgraph_export.errors import ExportError
from offgraph_export.passes.kv_sites import find_kv_sites
from offgraph_export.passes.record_step_width import user_input_nodes
from offgraph_export.specs.manifest import CacheManifest, LayerManifest

__all__ = ["strip_kv_cache", "STEP_IMPLS", "step_impl"]

STEP_IMPLS = ("portable", "triton")


def step_impl(name: str | Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The lowered step implementation called ``name`` (``portable`` or ``triton``). A callable
    with the signature of ``portable_update_and_attend`` is returned as is (custom steps)."""
    if callable(name):
        return name
    if name == "portable":
        from offgraph_export.lowering.portable import portable_update_and_attend

        return portable_update_and_attend
    if name == "triton":
        from offgraph_export.lowering.triton_attend import triton_update_and_attend

        return triton_update_and_attend
    raise ExportError(f"unknown step implementation {name!r}; expected one of {STEP_IMPLS}")


class _LayerStep:
    """Stands in for one neutral-op node: calls the step impl on the layer's bound storage."""

    def __init__(self, owner: "_StrippedModule", layer: LayerManifest) -> None:
        self.owner = owner
        self.layer = layer
        self.__name__ = f"offgraph_lowered_step_layer_{layer.layer_id}"

    def __call__(self, q, k, v, position, layer_id, scale, out_dtype):
        k_store, v_store = self.owner.bound[self.layer.layer_id]
        return self.owner.impl(
            q, k, v, position, k_store, v_store, self.layer.window, float(scale), out_dtype
        )


class _StrippedModule(torch.nn.Module):
    """``forward(*model_inputs, *storage)``: the original program with storage bound per layer."""

    def __init__(
        self, inner: torch.nn.Module, manifest: CacheManifest, n_inputs: int, names: Sequence[str],
        impl: Callable[..., torch.Tensor],
    ) -> None:
        super().__init__()
        self.inner = inner
        self.manifest = manifest
        self.n_inputs = n_inputs
        self.impl = impl
        self.bound: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

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
        storage = args[self.n_inputs :]
        by_index = {s.index - self.n_inputs: i for i, s in enumerate(self.manifest.storage_inputs())}
        self.bound = {
            layer.layer_id: (
                storage[by_index[layer.k.index - self.n_inputs]],
                storage[by_index[layer.v.index - self.n_inputs]],
            )
            for layer in self.manifest.layers
        }
        try:
            return self.inner(*args[: self.n_inputs])
        finally:
            self.bound = {}


def dynamic_dim(lo: int, hi: int | None) -> object:
    """A dynamic dimension hint with a range.

    ``Dim.DYNAMIC`` rather than a named strict ``Dim``: masked attention over storage produces
    guards such as ``T*min(16, 32*T) == 16*T`` (from contiguity checks) that hold on the whole
    range but that the strict solver cannot prove, on torch 2.11 and 2.13 alike. A hint accepts
    such guards and still fails if the dimension would be specialized to a constant.
    """
    try:
        return Dim.DYNAMIC(min=lo, max=hi) if hi is not None else Dim.DYNAMIC(min=lo)
    except TypeError:  # a torch whose hints take no range: unbounded hint, ranges checked at runtime
        return Dim.DYNAMIC


def _input_dynamic_shapes(ep: ExportedProgram) -> tuple[list[dict[int, Dim]], dict]:
    """Rebuild ``dynamic_shapes`` for the model inputs from the program's own symbols."""
    dims: dict[str, Dim] = {}
    shapes = []
    for node in user_input_nodes(ep):
        value = node.meta.get("val")
        spec: dict[int, Dim] = {}
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    expr = size.node.expr
                    key = str(expr)
                    if key not in dims:
                        rng = ep.range_constraints.get(expr)
                        if rng is None or not expr.is_symbol:
                            raise ExportError(
                                f"input {node.name} dim {d} has derived size {expr}; only plain "
                                "dynamic dims are supported"
                            )
                        hi = int(rng.upper) if rng.upper.is_finite else None
                        dims[key] = dynamic_dim(int(rng.lower), hi)
                    spec[d] = dims[key]
        shapes.append(spec)
    return shapes, dims


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


def strip_kv_cache(
    ep: ExportedProgram,
    manifest: CacheManifest,
    example_inputs: Sequence[torch.Tensor],
    impl: str | Callable[..., torch.Tensor] = "portable",
) -> ExportedProgram:
    """Return a new program: the model's inputs then the manifest's storage inputs, with every
    neutral op replaced by in-place row writes and attention over valid rows (``impl``)."""
    step = step_impl(impl)
    names = list(ep.graph_signature.user_inputs)
    if len(example_inputs) != len(names):
        raise ExportError(
            f"got {len(example_inputs)} example inputs but the program takes {len(names)} ({names})"
        )
    expected_first = len(names)
    if [s.index for s in manifest.storage_inputs()] != list(
        range(expected_first, expected_first + 2 * len(manifest.layers))
    ):
        raise ExportError(
            f"manifest storage indices {[s.index for s in manifest.storage_inputs()]} must follow "
            f"the {expected_first} model inputs contiguously"
        )
    gm = ep.module()
    sites = find_kv_sites(gm.graph)
    site_layers = sorted(s.layer_id for s in sites)  # type: ignore[type-var]
    if site_layers != sorted(manifest.layer_ids):
        raise ExportError(
            f"graph has KV ops for layers {site_layers} but the manifest lists {manifest.layer_ids}"
        )
    all_names = [*names, *(s.name for s in manifest.storage_inputs())]
    stripped = _StrippedModule.named(all_names)(gm, manifest, len(names), names, step)
    for site in sites:
        site.node.target = _LayerStep(stripped, manifest.layer(site.layer_id))  # type: ignore[arg-type]
    gm.recompile()

    input_shapes, _ = _input_dynamic_shapes(ep)
    taken = {int(s) for x in example_inputs for s in x.shape}
    capacity = _example_capacity(manifest, taken)
    dtype = getattr(torch, manifest.storage_dtype)
    device = example_inputs[0].device
    storage_args: list[torch.Tensor] = []
    flat: list[bool] = []
    for s in manifest.storage_inputs():
        layer = next(l for l in manifest.layers if s in (l.k, l.v))
        rows = layer.rows(capacity, manifest.max_write)
        dim = layer.head_dim if s == layer.k else layer.v_head_dim
        storage_args.append(
            torch.zeros(manifest.batch_size, layer.kv_heads, rows, dim, dtype=dtype, device=device)
        )
        flat.append(layer.policy == "flat")

    def trace(capacity_dim: Callable[[], object]) -> ExportedProgram:
        storage_shapes = [{2: capacity_dim()} if f else {} for f in flat]
        return torch.export.export(
            stripped,
            (*example_inputs, *storage_args),
            dynamic_shapes=(*input_shapes, *storage_shapes),
            strict=False,
        )

    shared = Dim("capacity", min=2, max=manifest.max_capacity)
    try:
        try:
            # One named dimension shared by every flat layer: they grow together.
            new_ep = trace(lambda: shared)
        except torch._dynamo.exc.UserError as exc:
            if exc.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
                raise
            # Some torch versions cannot prove guards over a strict named range (see
            # dynamic_dim); fall back to one range hint per flat storage input.
            new_ep = trace(lambda: dynamic_dim(2, manifest.max_capacity))
    except Exception as exc:  # export raises many types; re-raise as ours with the cause chained
        raise ExportError(f"re-tracing the stripped program failed: {exc}") from exc

    got = list(new_ep.graph_signature.user_inputs)
    if got != all_names:
        raise ExportError(f"stripped program inputs are {got}, expected {all_names}")
    left = find_kv_sites(new_ep.graph)
    if left:
        raise ExportError(f"KV op nodes survived the strip: {[s.node.name for s in left]}")
    return new_ep
