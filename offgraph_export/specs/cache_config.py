"""The user's cache configuration: which layers are ring (sliding-window) layers, capacities,
storage dtype.

Export combines it with what the traced graph says (heads, head dims) into the manifest; the eager
reference caches are built from it too, so oracle and artifact agree on capacity and windows. A
layer's policy is its window, as in the manifest: a layer with no window is flat.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from offgraph_export.errors import SpecError
from offgraph_export.specs.manifest import BATCH_INPUTS, CacheManifest, StorageDtype, pages_for

__all__ = ["CacheConfig"]


class CacheConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_capacity: int = Field(default=1024, ge=1, description="hard bound of tokens per session")
    initial_capacity: int = Field(default=64, ge=1, description="flat rows allocated up front")
    max_write: int = Field(default=128, ge=1, description="most tokens one step may write")
    storage_dtype: StorageDtype = "float32"
    ring_windows: dict[int, int] = Field(
        default_factory=dict, description="layer id -> sliding window; layers not named are flat"
    )
    max_sessions: int | None = Field(
        default=None, ge=1, description="a batched artifact: sessions one step carries (None: one session per program)"
    )
    page_size: int = Field(default=16, ge=1, description="rows per page of a batched artifact's pools (a power of two)")
    pool_pages: int | None = Field(
        default=None, ge=2, description="default pool of a batched artifact, pages (None: every session at max_capacity)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "CacheConfig":
        if self.initial_capacity > self.max_capacity:
            raise ValueError(
                f"initial_capacity={self.initial_capacity} exceeds max_capacity={self.max_capacity}"
            )
        if self.max_write > self.max_capacity:
            raise ValueError(
                f"max_write={self.max_write} exceeds max_capacity={self.max_capacity}"
            )
        for layer_id, window in self.ring_windows.items():
            if window < 1:
                raise ValueError(f"ring layer {layer_id} needs a positive window, got {window}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.max_sessions is None and self.pool_pages is not None:
            raise ValueError("pool_pages sizes a batched artifact's pool: give max_sessions too")
        return self

    def paging(self, first_index: int) -> dict[str, object] | None:
        """The manifest's ``paging`` (design section 10) when batched, its inputs from
        ``first_index`` on (after the storage); None for a one-session artifact."""
        if self.max_sessions is None:
            return None
        per_session = pages_for(self.max_capacity, self.page_size)
        pool = self.pool_pages if self.pool_pages is not None else 1 + self.max_sessions * per_session
        return dict(
            max_sessions=self.max_sessions, page_size=self.page_size, pages_per_session=per_session, pool_pages=pool,
            inputs=[dict(name=n, index=first_index + i) for i, n in enumerate(BATCH_INPUTS)],
        )

    def window(self, layer_id: int) -> int | None:
        """The layer's sliding window, or None for a flat layer."""
        return self.ring_windows.get(layer_id)

    def with_overrides(
        self,
        max_capacity: int | None = None,
        initial_capacity: int | None = None,
        max_write: int | None = None,
        storage_dtype: StorageDtype | None = None,
        rings: Mapping[int, int] | Iterable[tuple[int, int]] = (),
        all_flat: bool = False,
        max_sessions: int | None = None,
        page_size: int | None = None,
        pool_pages: int | None = None,
    ) -> "CacheConfig":
        """A new config with the given fields replaced (None keeps the current value).
        ``all_flat`` drops this config's ring layers; ``rings`` then adds or replaces windows.
        Raises :class:`SpecError` naming the field when the result is inconsistent."""
        update: dict[str, object] = {
            key: value
            for key, value in dict(
                max_capacity=max_capacity, initial_capacity=initial_capacity,
                max_write=max_write, storage_dtype=storage_dtype, max_sessions=max_sessions,
                page_size=page_size, pool_pages=pool_pages,
            ).items()
            if value is not None
        }
        windows = {} if all_flat else dict(self.ring_windows)
        windows.update(dict(rings))
        update["ring_windows"] = windows
        try:
            return CacheConfig.model_validate({**self.model_dump(), **update})
        except ValidationError as exc:
            raise SpecError(f"invalid cache configuration: {_errors(exc)}") from exc

    @classmethod
    def of_manifest(cls, manifest: CacheManifest) -> "CacheConfig":
        """The configuration a manifest was built from (the eager oracle's caches use it)."""
        return cls(
            max_capacity=manifest.max_capacity,
            initial_capacity=manifest.initial_capacity,
            max_write=manifest.max_write,
            storage_dtype=manifest.storage_dtype,
            ring_windows={l.layer_id: l.window for l in manifest.layers if l.window is not None},
            **(
                {}
                if manifest.paging is None
                else dict(max_sessions=manifest.paging.max_sessions, page_size=manifest.paging.page_size,
                          pool_pages=manifest.paging.pool_pages)
            ),
        )


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        (".".join(str(p) for p in err["loc"]) + ": " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
        for err in exc.errors()
    )
