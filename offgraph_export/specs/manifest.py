"""The cache manifest compile spec (``offgraph_kv_manifest``): versioned JSON describing the
off-graph KV storage a lowered program expects, layer by layer.

The strip pass follows it to add storage inputs; the runtime follows it to allocate, grow and bind
storage; the check compares it with the program's real inputs.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from offgraph_export.errors import SpecError

__all__ = [
    "MANIFEST_KEY",
    "MANIFEST_VERSION",
    "STORAGE_DTYPES",
    "StorageInput",
    "LayerManifest",
    "CacheManifest",
    "parse_manifest",
]

MANIFEST_KEY = "offgraph_kv_manifest"
MANIFEST_VERSION = 1
STORAGE_DTYPES = ("float32", "float16", "bfloat16")

Policy = Literal["flat", "ring"]


class StorageInput(BaseModel):
    """One storage tensor input of the lowered program, ``[batch, kv_heads, rows, head_dim]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    index: int = Field(ge=0)


class LayerManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    layer_id: int = Field(ge=0)
    policy: Policy
    window: int | None = None
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    v_head_dim: int = Field(ge=1)
    k: StorageInput
    v: StorageInput

    @model_validator(mode="after")
    def _window_matches_policy(self) -> "LayerManifest":
        if self.policy == "ring" and (self.window is None or self.window < 1):
            raise ValueError(
                f"layer {self.layer_id}: a ring layer needs a positive window, got {self.window!r}"
            )
        if self.policy == "flat" and self.window is not None:
            raise ValueError(
                f"layer {self.layer_id}: a flat layer keeps all history and takes no window, "
                f"got window={self.window!r}"
            )
        return self

    def rows(self, capacity: int, max_write: int) -> int:
        """Storage rows for this layer at a given flat capacity."""
        if self.policy == "ring":
            assert self.window is not None
            return self.window + max_write - 1
        return capacity


class CacheManifest(BaseModel):
    """What storage the program expects. ``max_capacity``/``initial_capacity`` are in tokens
    (rows of flat layers); ring layers are fixed at ``window + max_write - 1`` rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # strict: a version must be exactly the integer, never coerced from "1", true or 1.0
    version: int = Field(strict=True)
    storage_dtype: Literal["float32", "float16", "bfloat16"]
    batch_size: int = Field(ge=1)
    max_capacity: int = Field(ge=1)
    initial_capacity: int = Field(ge=1)
    max_write: int = Field(ge=1)
    layers: list[LayerManifest] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> "CacheManifest":
        if self.version != MANIFEST_VERSION:
            raise ValueError(
                f"unknown manifest version {self.version!r}; this build reads version {MANIFEST_VERSION}"
            )
        if not 1 <= self.max_write <= self.max_capacity:
            raise ValueError(
                f"max_write={self.max_write} must lie in [1, max_capacity={self.max_capacity}]"
            )
        if self.initial_capacity > self.max_capacity:
            raise ValueError(
                f"initial_capacity={self.initial_capacity} exceeds max_capacity={self.max_capacity}"
            )
        seen: set[int] = set()
        names: set[str] = set()
        indices: set[int] = set()
        for layer in self.layers:
            if layer.layer_id in seen:
                raise ValueError(f"duplicate layer id {layer.layer_id} in manifest")
            seen.add(layer.layer_id)
            for storage in (layer.k, layer.v):
                if storage.name in names:
                    raise ValueError(f"storage input name {storage.name!r} used twice")
                if storage.index in indices:
                    raise ValueError(f"storage input index {storage.index} used twice")
                names.add(storage.name)
                indices.add(storage.index)
        return self

    def layer(self, layer_id: int) -> LayerManifest:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise KeyError(f"layer {layer_id} is not in the manifest (layers: {self.layer_ids})")

    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    @property
    def has_flat(self) -> bool:
        return any(layer.policy == "flat" for layer in self.layers)

    def storage_inputs(self) -> list[StorageInput]:
        """Storage inputs in program-input order."""
        return sorted((s for layer in self.layers for s in (layer.k, layer.v)), key=lambda s: s.index)

    def to_json(self) -> str:
        return self.model_dump_json()


def parse_manifest(text: str | bytes) -> CacheManifest:
    """Parse and validate manifest JSON; raise :class:`SpecError` with every problem found."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{MANIFEST_KEY} is not valid JSON: {exc}") from exc
    if isinstance(data, dict) and "version" in data and (
        type(data["version"]) is not int or data["version"] != MANIFEST_VERSION
    ):
        raise SpecError(
            f"unknown {MANIFEST_KEY} version {data['version']!r}; this build reads version "
            f"{MANIFEST_VERSION}"
        )
    try:
        return CacheManifest.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"invalid {MANIFEST_KEY}: {exc}") from exc
