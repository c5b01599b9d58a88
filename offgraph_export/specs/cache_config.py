"""The user's cache configuration: which layers are flat or ring, capacities, storage dtype.

Export combines it with what the traced graph says (heads, head dims) into the manifest; the eager
reference caches are built from it too, so oracle and artifact agree on capacity and windows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CacheConfig"]


class CacheConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_capacity: int = Field(default=1024, ge=1, description="hard bound of tokens per session")
    initial_capacity: int = Field(default=64, ge=1, description="flat rows allocated up front")
    max_write: int = Field(default=128, ge=1, description="most tokens one step may write")
    storage_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    ring_windows: dict[int, int] = Field(
        default_factory=dict, description="layer id -> sliding window; layers not named are flat"
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
        return self

    def policy(self, layer_id: int) -> Literal["flat", "ring"]:
        return "ring" if layer_id in self.ring_windows else "flat"

    def window(self, layer_id: int) -> int | None:
        return self.ring_windows.get(layer_id)
