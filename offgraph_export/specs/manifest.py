"""The cache manifest compile spec (``offgraph_kv_manifest``) and the storage rules it implies.

The manifest is versioned JSON describing the off-graph KV storage a lowered program expects, layer
by layer. The strip pass follows it to add storage inputs; the runtime follows it to allocate, grow
and bind storage; the check compares it with the program's real inputs.

This module is also the one place that defines the storage rules every other module imports:

* a layer's policy is encoded once, by ``window``: ``None`` keeps all history (flat), an int is a
  sliding window of that many positions (ring); ``policy`` is derived from it for readers;
* :func:`ring_rows`: a ring layer holds ``window + max_write - 1`` rows, enough that a step of
  ``max_write`` tokens never overwrites a row its own queries still need;
* :meth:`LayerManifest.rows`: flat layers hold ``capacity`` rows (they grow together), ring layers
  :func:`ring_rows`;
* :func:`storage_row`: the row of an absolute position is ``position mod rows``. A flat layer is a
  ring that never wraps (its rows exceed every position it holds), so one formula serves both;
* :func:`row_position`: the inverse, the position a row holds once positions up to ``last`` are
  written (negative: the row was never written);
* :meth:`CacheManifest.storage_shape` and :meth:`CacheManifest.owner`: the shape of a storage input
  ``[batch, kv_heads, rows, head_dim | v_head_dim]`` and which layer (K or V) owns it;
* :func:`storage_names` and :func:`storage_index`: the storage inputs follow the model's own inputs,
  K then V per layer, in the order of the layers, and each is named after its layer (a manifest
  whose names disagree is refused, so names are unique because layer ids are).
"""

from __future__ import annotations

from functools import cached_property

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    model_serializer,
    model_validator,
)

from offgraph_export.errors import SpecError
from offgraph_export.specs.limits import MAX_SPEC_VALUES, LimitedItems, loads_limited

__all__ = [
    "MANIFEST_KEY",
    "MANIFEST_VERSION",
    "MAX_EXTENT",
    "MAX_STORAGE_ELEMENTS",
    "StorageDtype",
    "Which",
    "StorageInput",
    "LayerManifest",
    "CacheManifest",
    "parse_manifest",
    "ring_rows",
    "storage_row",
    "row_position",
    "storage_names",
    "storage_index",
    "PAGED_MANIFEST_VERSION",
    "BATCH_INPUTS",
    "PagingManifest",
    "paged_row",
    "pages_for",
]

MANIFEST_KEY = "offgraph_kv_manifest"
MANIFEST_VERSION = 1
#: the version of a manifest with ``paging`` (a batched artifact, design section 10)
PAGED_MANIFEST_VERSION = 2
#: the four runtime-bound inputs of a batched program, in order, after the storage inputs
BATCH_INPUTS = ("token_slots", "token_rows", "page_table", "session_lengths")
#: the largest page (rows)
MAX_PAGE_SIZE = 2**16

StorageDtype = Literal["float32", "float16", "bfloat16"]
#: The largest count, size or position a manifest may name: the compiled kernels hold positions
#: and rows as int32.
MAX_EXTENT = 2**31 - 1
#: The most elements one storage tensor may have at ``max_capacity`` (2**48: 512 TB in bf16, past
#: any device; a larger product overflows torch's size arithmetic before any allocation).
MAX_STORAGE_ELEMENTS = 2**48
Which = Literal["k", "v"]
Policy = Literal["flat", "ring"]

Index = TypeVar("Index")


# --- the storage rules -----------------------------------------------------------------------


def ring_rows(window: int, max_write: int) -> int:
    """Rows of a ring layer of ``window`` positions when a step writes up to ``max_write`` tokens:
    the oldest query of a step still sees ``window - 1`` older positions while the step's
    ``max_write`` rows are written."""
    return window + max_write - 1


def storage_row(position: Index, rows: int | Any) -> Index:
    """The storage row that holds absolute ``position``: ``position mod rows``.

    Works on ints, SymInts and integer tensors alike (``%`` is the floor modulo on all three). A flat
    layer's rows exceed every position it holds, so there the row is the position itself."""
    return position % rows  # type: ignore[operator]


def row_position(row: Index, last: Any, rows: int | Any) -> Index:
    """The absolute position ``row`` holds once positions ``0..last`` were written in order:
    ``last - ((last - row) mod rows)``. Negative for a row never written (flat rows past
    ``last``); the inverse of :func:`storage_row` on the rows that were."""
    return last - (last - row) % rows  # type: ignore[operator]


def storage_names(layer_id: int) -> tuple[str, str]:
    """Names of a layer's K and V storage inputs."""
    return f"k_cache_{layer_id}", f"v_cache_{layer_id}"


def storage_index(n_model_inputs: int, layer_order: int, which: Which) -> int:
    """Program-input index of the K or V storage of the ``layer_order``-th layer: storage follows
    the model's ``n_model_inputs`` inputs, K then V per layer."""
    return n_model_inputs + 2 * layer_order + (0 if which == "k" else 1)


def paged_row(pages: Any, position: Any, page_size: int) -> Any:
    """The pool row (the pool viewed as ``[pages * page_size, ...]``) holding ``position`` of a
    session whose pages, in order, are ``pages``: ``pages[p // page_size] * page_size + p %
    page_size``. ``pages`` a list and ``position`` an int; or integer tensors, ``pages``
    ``[..., P]`` and ``position`` ``[..., L]`` (the lookup a ``gather`` along the last dim)."""
    index = position // page_size
    page = pages[index] if isinstance(pages, (list, tuple)) else pages.gather(-1, index)
    return page * page_size + position % page_size


def pages_for(tokens: int, page_size: int) -> int:
    """Pages a session of ``tokens`` tokens holds: ``ceil(tokens / page_size)``."""
    return -(-tokens // page_size)


# --- the manifest ----------------------------------------------------------------------------


class StorageInput(BaseModel):
    """One storage tensor input of the lowered program, ``[batch, kv_heads, rows, head_dim]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    index: int = Field(ge=0, le=MAX_EXTENT)


class LayerManifest(BaseModel):
    """One layer's storage: ``window`` None is flat (all history), an int a ring of that window."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer_id: int = Field(ge=0, le=MAX_EXTENT)
    window: int | None = Field(default=None, ge=1, le=MAX_EXTENT, strict=True)
    kv_heads: int = Field(ge=1, le=MAX_EXTENT)
    head_dim: int = Field(ge=1, le=MAX_EXTENT)
    v_head_dim: int = Field(ge=1, le=MAX_EXTENT)
    k: StorageInput
    v: StorageInput

    @model_validator(mode="before")
    @classmethod
    def _policy_matches_window(cls, data: Any) -> Any:
        """``policy`` is serialized for readers of the JSON and may be omitted on input; given, it
        must agree with ``window``."""
        if not isinstance(data, dict) or "policy" not in data:
            return data
        data = dict(data)
        layer = data.get("layer_id")
        window = data.get("window")
        policy = data.pop("policy")
        if policy not in ("flat", "ring"):
            raise ValueError(f"layer {layer}: unknown policy {policy!r}; expected 'flat' or 'ring'")
        if policy == "ring" and (type(window) is not int or window < 1):
            raise ValueError(f"layer {layer}: a ring layer needs a positive window, got {window!r}")
        if policy == "flat" and window is not None:
            raise ValueError(
                f"layer {layer}: a flat layer keeps all history and takes no window, "
                f"got window={window!r}"
            )
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def policy(self) -> Policy:
        return "flat" if self.window is None else "ring"

    def rows(self, capacity: int, max_write: int) -> int:
        """Storage rows of this layer when flat layers hold ``capacity`` rows."""
        return capacity if self.window is None else ring_rows(self.window, max_write)

    @model_validator(mode="after")
    def _named_after_layer(self) -> "LayerManifest":
        for which, storage, expected in zip(("K", "V"), (self.k, self.v), storage_names(self.layer_id)):
            if storage.name != expected:
                raise ValueError(
                    f"layer {self.layer_id}: its {which} storage input is named {storage.name!r}; "
                    f"expected {expected!r}"
                )
        return self

    def head_dim_of(self, which: Which) -> int:
        return self.head_dim if which == "k" else self.v_head_dim


class PagingManifest(BaseModel):
    """How a batched program's flat storage is paged and which inputs carry the batch (design
    section 10). Slot 0 and page 0 are the scratch slot and page of padding tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_sessions: int = Field(ge=1, le=MAX_EXTENT)
    page_size: int = Field(ge=1, le=MAX_PAGE_SIZE)
    pages_per_session: int = Field(ge=1, le=MAX_EXTENT)
    pool_pages: int = Field(ge=2, le=MAX_EXTENT)
    inputs: list[StorageInput] = Field(min_length=len(BATCH_INPUTS), max_length=len(BATCH_INPUTS))

    @model_validator(mode="after")
    def _consistent(self) -> "PagingManifest":
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        names = tuple(i.name for i in self.inputs)
        if names != BATCH_INPUTS:
            raise ValueError(f"paging inputs are named {list(names)}; expected {list(BATCH_INPUTS)} in that order")
        if not 2 <= self.pool_pages <= self.max_pool_pages:
            raise ValueError(
                f"pool_pages={self.pool_pages} must lie in [2, {self.max_pool_pages}] (the scratch page plus "
                f"max_sessions * pages_per_session)"
            )
        if self.max_pool_pages * self.page_size > MAX_EXTENT:
            raise ValueError(f"{self.max_pool_pages} pages of {self.page_size} rows exceed {MAX_EXTENT} pool rows")
        return self

    @property
    def max_pool_pages(self) -> int:
        """The largest useful pool: every session at full capacity, plus the scratch page."""
        return 1 + self.max_sessions * self.pages_per_session

    @property
    def slots(self) -> int:
        """Rows of the page table and ring slots: the sessions plus the scratch slot."""
        return self.max_sessions + 1

    def check_follows(self, first_index: int) -> None:
        """The batch inputs are the program inputs from ``first_index`` on, in order."""
        got = [i.index for i in self.inputs]
        want = list(range(first_index, first_index + len(BATCH_INPUTS)))
        if got != want:
            raise SpecError(f"paging inputs have indices {got}; they must follow the storage inputs: {want}")

    def input_shape(self, name: str, width: int | str) -> tuple[int | str, ...]:
        """The shape of batch input ``name`` for a step of ``width`` tokens."""
        if name == "page_table":
            return (self.slots, self.pages_per_session)
        if name == "session_lengths":
            return (self.slots,)
        return (width,)


class CacheManifest(BaseModel):
    """What storage the program expects. ``max_capacity``/``initial_capacity`` are in tokens
    (rows of flat layers); ring layers are fixed at :func:`ring_rows` rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # strict: a version must be exactly the integer, never coerced from "1", true or 1.0
    version: int = Field(strict=True)
    storage_dtype: StorageDtype
    batch_size: int = Field(ge=1, le=MAX_EXTENT)
    max_capacity: int = Field(ge=1, le=MAX_EXTENT)
    initial_capacity: int = Field(ge=1, le=MAX_EXTENT)
    max_write: int = Field(ge=1, le=MAX_EXTENT)
    #: at most MAX_SPEC_ITEMS, counted before any layer is validated
    layers: Annotated[list[LayerManifest], LimitedItems] = Field(min_length=1)
    #: a batched program's paging (version 2 only); None: one session per program
    paging: PagingManifest | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "CacheManifest":
        want = MANIFEST_VERSION if self.paging is None else PAGED_MANIFEST_VERSION
        if self.version != want:
            raise ValueError(
                f"unknown manifest version {self.version!r}; this build reads version {MANIFEST_VERSION}"
                + ("" if self.paging is None else f" ({PAGED_MANIFEST_VERSION} with paging)")
            )
        if self.paging is not None:
            if self.batch_size != 1:
                raise ValueError(f"a paged manifest packs sessions along the tokens; its batch_size must be 1, got {self.batch_size}")
            if self.paging.pages_per_session != pages_for(self.max_capacity, self.paging.page_size):
                raise ValueError(
                    f"pages_per_session={self.paging.pages_per_session} must be ceil(max_capacity / page_size) = "
                    f"{pages_for(self.max_capacity, self.paging.page_size)}"
                )
            self.paging.check_follows(max((s.index for l in self.layers for s in (l.k, l.v)), default=-1) + 1)
        if not 1 <= self.max_write <= self.max_capacity:
            raise ValueError(
                f"max_write={self.max_write} must lie in [1, max_capacity={self.max_capacity}]"
            )
        if self.initial_capacity > self.max_capacity:
            raise ValueError(
                f"initial_capacity={self.initial_capacity} exceeds max_capacity={self.max_capacity}"
            )
        seen: set[int] = set()
        indices: set[int] = set()
        for layer in self.layers:
            rows = self.rows(layer, self.max_capacity)
            if rows > MAX_EXTENT:
                raise ValueError(f"layer {layer.layer_id}: {rows} storage rows; at most {MAX_EXTENT}")
            if self.paging is not None:  # all slots' rings, or the largest pool
                rows = rows * self.paging.slots if layer.window is not None else self.paging.max_pool_pages * self.paging.page_size
            elements = self.batch_size * layer.kv_heads * rows * max(layer.head_dim, layer.v_head_dim)
            if elements > MAX_STORAGE_ELEMENTS:
                raise ValueError(
                    f"layer {layer.layer_id}: storage of {elements} elements at max_capacity; "
                    f"at most {MAX_STORAGE_ELEMENTS}"
                )
            if layer.layer_id in seen:
                raise ValueError(f"duplicate layer id {layer.layer_id} in manifest")
            seen.add(layer.layer_id)
            for storage in (layer.k, layer.v):  # names are unique: storage_names of unique ids
                if storage.index in indices:
                    raise ValueError(f"storage input index {storage.index} used twice")
                indices.add(storage.index)
        return self

    # --- lookups -------------------------------------------------------------------------------

    @cached_property
    def _by_layer_id(self) -> dict[int, LayerManifest]:
        return {layer.layer_id: layer for layer in self.layers}

    @cached_property
    def _owners(self) -> dict[StorageInput, tuple[LayerManifest, Which]]:
        owners: dict[StorageInput, tuple[LayerManifest, Which]] = {}
        for layer in self.layers:
            owners[layer.k] = (layer, "k")
            owners[layer.v] = (layer, "v")
        return owners

    def layer(self, layer_id: int) -> LayerManifest:
        layer = self._by_layer_id.get(layer_id)
        if layer is None:
            raise SpecError(f"layer {layer_id} is not in the manifest (layers: {self.layer_ids})")
        return layer

    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    @property
    def has_flat(self) -> bool:
        return any(layer.window is None for layer in self.layers)

    def storage_inputs(self) -> list[StorageInput]:
        """Storage inputs in program-input order."""
        return sorted((s for layer in self.layers for s in (layer.k, layer.v)), key=lambda s: s.index)

    def owner(self, storage: StorageInput) -> tuple[LayerManifest, Which]:
        """The layer whose K or V ``storage`` is."""
        owner = self._owners.get(storage)
        if owner is None:
            raise SpecError(f"storage input {storage.name!r} (index {storage.index}) is in no layer")
        return owner

    # --- the storage rules, applied ------------------------------------------------------------

    def rows(self, layer: LayerManifest, capacity: int) -> int:
        """Rows of ``layer``'s storage when flat layers hold ``capacity`` rows."""
        return layer.rows(capacity, self.max_write)

    def storage_shape(self, storage: StorageInput, capacity: int) -> tuple[int, int, int, int]:
        """``[batch, kv_heads, rows, head_dim | v_head_dim]`` of a storage input when flat layers
        hold ``capacity`` rows. Paged (``capacity``: the pool's pages): a flat layer's pool
        ``[pages, page_size, kv_heads, dim]``, a ring layer's rings ``[slots, kv_heads, rows, dim]``."""
        layer, which = self.owner(storage)
        dim = layer.head_dim_of(which)
        if self.paging is not None:
            if layer.window is None:
                return (capacity, self.paging.page_size, layer.kv_heads, dim)
            return (self.paging.slots, layer.kv_heads, self.rows(layer, capacity), dim)
        return (self.batch_size, layer.kv_heads, self.rows(layer, capacity), dim)

    def check_follows(self, n_model_inputs: int) -> None:
        """Raise :class:`SpecError` unless the storage inputs are exactly the program inputs that
        follow the model's ``n_model_inputs``, K then V per layer in the order of ``layers``
        (:func:`storage_index`)."""
        got = [(layer.k.index, layer.v.index) for layer in self.layers]
        want = [
            (storage_index(n_model_inputs, i, "k"), storage_index(n_model_inputs, i, "v"))
            for i in range(len(self.layers))
        ]
        if got != want:
            raise SpecError(
                f"manifest storage indices (k, v) per layer {got} must follow the "
                f"{n_model_inputs} model inputs, K then V per layer: {want}"
            )

    @model_serializer(mode="wrap")
    def _without_absent_paging(self, handler: Any) -> Any:
        """A one-session manifest serializes as before paging existed (no ``"paging": null``), so
        its JSON, and every artifact's metadata built from it, is unchanged."""
        data = handler(self)
        if isinstance(data, dict) and data.get("paging", 0) is None:
            del data["paging"]
        return data

    def to_json(self) -> str:
        return self.model_dump_json()


def parse_manifest(text: str | bytes) -> CacheManifest:
    """Parse and validate manifest JSON; raise :class:`SpecError` with every problem found."""
    data = loads_limited(text, MANIFEST_KEY, max_values=MAX_SPEC_VALUES)
    if isinstance(data, dict) and "version" in data and (
        type(data["version"]) is not int or data["version"] not in (MANIFEST_VERSION, PAGED_MANIFEST_VERSION)
    ):
        raise SpecError(
            f"unknown {MANIFEST_KEY} version {data['version']!r}; this build reads version "
            f"{MANIFEST_VERSION}"
        )
    try:
        return CacheManifest.model_validate(data, strict=True)  # no "256" or 1.0 or true for an int
    except ValidationError as exc:
        raise SpecError(f"invalid {MANIFEST_KEY}: {exc}") from exc
