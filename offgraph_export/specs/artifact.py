"""What an artifact carries besides compiled code: both compile specs plus a description of the
program's inputs, stored as one JSON entry in the ``.pt2`` archive so it can be read (by
``inspect``, by the runtime before loading) without loading the compiled code."""

from __future__ import annotations

import os
import zipfile
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from offgraph_export.errors import ArtifactError, SpecError
from offgraph_export.specs.limits import loads_limited
from offgraph_export.specs.manifest import CacheManifest
from offgraph_export.specs.step_width import StepWidthSpec, parse_step_width

__all__ = [
    "ARTIFACT_SPECS_VERSION",
    "SPECS_ENTRY",
    "InputSpec",
    "SymbolRange",
    "ArtifactSpecs",
    "parse_artifact_specs",
    "read_artifact_specs",
    "write_artifact_specs",
    "archive_entries",
]

ARTIFACT_SPECS_VERSION = 1


class InputSpec(BaseModel):
    """One model input: ``shape`` entries are ints (static) or symbol names (dynamic, shared by
    inputs whose extents must agree), with the symbol's range in ``ArtifactSpecs.symbols``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    dtype: str
    shape: list[int | str]


class SymbolRange(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    min: int
    max: int | None


class ArtifactSpecs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(default=ARTIFACT_SPECS_VERSION, strict=True)
    #: Parsed once, when the specs are read; serialized as the ``"input_index:dim"`` text.
    step_width: StepWidthSpec
    manifest: CacheManifest
    device: Literal["cpu", "cuda"]
    step_impl: str
    inputs: list[InputSpec] = Field(min_length=1)
    symbols: dict[str, SymbolRange] = Field(default_factory=dict)
    torch_version: str
    model: str = ""
    model_args: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    model_dtype: str | None = None

    @field_validator("step_width", mode="before")
    @classmethod
    def _parse_width(cls, value: object) -> object:
        return value if isinstance(value, StepWidthSpec) else parse_step_width(value)

    @field_serializer("step_width")
    def _format_width(self, value: StepWidthSpec) -> str:
        return value.format()

    @model_validator(mode="after")
    def _consistent(self) -> "ArtifactSpecs":
        if self.version != ARTIFACT_SPECS_VERSION:
            raise ValueError(f"unknown artifact specs version {self.version}")
        spec = self.step_width
        n = len(self.inputs)
        if spec.input_index >= n:
            raise ValueError(
                f"step width {self.step_width!r} names input {spec.input_index} but the model "
                f"has {n} inputs ({[i.name for i in self.inputs]})"
            )
        rank = len(self.inputs[spec.input_index].shape)
        if spec.dim >= rank:
            raise ValueError(
                f"step width {self.step_width!r} names dim {spec.dim} of input "
                f"{self.inputs[spec.input_index].name!r}, which has rank {rank}"
            )
        extent = self.inputs[spec.input_index].shape[spec.dim]
        if not isinstance(extent, str):
            raise ValueError(
                f"step width {self.step_width!r} names a static dim (extent {extent}); it must be "
                "the dynamic token dimension"
            )
        self.manifest.check_follows(n)
        return self

    @property
    def width_symbol(self) -> str:
        spec = self.step_width
        return str(self.inputs[spec.input_index].shape[spec.dim])


def parse_artifact_specs(text: str | bytes, source: str = "artifact") -> ArtifactSpecs:
    data = loads_limited(text, f"{source}: offgraph specs entry", ArtifactError)
    try:
        return ArtifactSpecs.model_validate(data)
    except (ValidationError, SpecError) as exc:
        raise ArtifactError(f"{source}: invalid offgraph specs: {exc}") from exc


SPECS_ENTRY = "extra/offgraph_specs.json"


def _archive_root(names: list[str], source: str) -> str:
    for name in names:
        if name.endswith("/archive_format") or name == "archive_format":
            return name[: -len("archive_format")]
    raise ArtifactError(f"{source} is not a PT2 archive (no archive_format entry)")


def read_artifact_specs(path: str | os.PathLike) -> ArtifactSpecs:
    """Read the specs of a ``.pt2`` package from its archive, without loading compiled code."""
    source = str(path)
    if not os.path.isfile(path):
        raise ArtifactError(f"artifact {source!r} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            entry = _archive_root(names, source) + SPECS_ENTRY
            if entry not in names:
                raise ArtifactError(
                    f"{source} has no offgraph specs ({SPECS_ENTRY}); was it built by "
                    "`offgraph-export export`?"
                )
            text = archive.read(entry)
    except zipfile.BadZipFile as exc:
        raise ArtifactError(f"{source} is not a readable .pt2 archive: {exc}") from exc
    return parse_artifact_specs(text, source)


def write_artifact_specs(path: str | os.PathLike, specs: ArtifactSpecs) -> None:
    """Add the specs entry to an existing ``.pt2`` archive."""
    with zipfile.ZipFile(path, "a") as archive:
        entry = _archive_root(archive.namelist(), str(path)) + SPECS_ENTRY
        archive.writestr(entry, specs.model_dump_json(indent=2))


def archive_entries(path: str | os.PathLike) -> list[tuple[str, int]]:
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, info.file_size) for info in archive.infolist()]
