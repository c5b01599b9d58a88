"""What an artifact carries besides compiled code: both compile specs plus a description of the
program's inputs (which one carries the positions, which index a table and up to what bound),
stored as one JSON entry in the ``.pt2`` archive so it can be read (by ``inspect``, by the runtime
before loading) without loading the compiled code. The same description is compiled into the
program's own metadata (:data:`PROGRAM_KEY`), and a loader refuses specs that disagree with it."""

from __future__ import annotations

import json
import os
import zipfile
from typing import Annotated, Literal

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
from offgraph_export.specs.archive import UNREADABLE_MEMBER, archive_root, check_archive
from offgraph_export.specs.limits import MAX_JSON_BYTES, MAX_SPEC_VALUES, LimitedItems, loads_limited
from offgraph_export.specs.manifest import CacheManifest
from offgraph_export.specs.quantization import QuantizationSpec
from offgraph_export.specs.step_width import StepWidthSpec, parse_step_width

__all__ = [
    "ARTIFACT_SPECS_VERSION",
    "PROGRAM_KEY",
    "METHOD_KEY",
    "STEP_METHOD",
    "DECODE_METHOD",
    "SESSIONS_METHOD",
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
#: AOTI metadata key of the program description (:meth:`ArtifactSpecs.program_description`).
PROGRAM_KEY = "offgraph_program"
#: AOTI metadata key naming the method a compiled program is (:data:`STEP_METHOD` or :data:`DECODE_METHOD`).
METHOD_KEY = "offgraph_method"
#: The general step (any width in the symbol's range); AOTI's default model name, so a plain
#: ``aoti_load_package`` finds it.
STEP_METHOD = "model"
#: The width-1 step compiled with static shapes (present when ``ArtifactSpecs.decode_method``).
DECODE_METHOD = "decode"
#: A batched artifact's method for decode steps of several sessions (design section 10): the
#: general step with every token its session's only new row.
SESSIONS_METHOD = "sessions"

TensorDtype = Literal[
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"
]


class InputSpec(BaseModel):
    """One model input: ``shape`` entries are ints (static) or symbol names (dynamic, shared by
    inputs whose extents must agree), with the symbol's range in ``ArtifactSpecs.symbols``.
    ``index_bound``: the input indexes a table of that many rows, so its values must lie in
    ``[0, index_bound)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    dtype: TensorDtype
    shape: Annotated[list[int | str], LimitedItems]
    index_bound: int | None = Field(default=None, ge=1)

    @field_validator("shape")
    @classmethod
    def _sizes(cls, shape: list[int | str]) -> list[int | str]:
        for size in shape:
            if isinstance(size, int) and size < 0:
                raise ValueError(f"a static size must be >= 0, got {size}")
            if isinstance(size, str) and not size:
                raise ValueError("a dynamic size needs a symbol name")
        return shape


class SymbolRange(BaseModel):
    """``[min, max]`` of a dynamic size. ``max`` None (unbounded) is only how the passes describe a
    symbol before its range is settled: :class:`ArtifactSpecs` takes bounded ranges only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min: int = Field(ge=0)
    max: int | None

    @model_validator(mode="after")
    def _ordered(self) -> "SymbolRange":
        if self.max is not None and self.max < self.min:
            raise ValueError(f"range [{self.min}, {self.max}] is empty (min > max)")
        return self


class ArtifactSpecs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(default=ARTIFACT_SPECS_VERSION, strict=True)
    #: Parsed once, when the specs are read; serialized as the ``"input_index:dim"`` text.
    step_width: StepWidthSpec
    manifest: CacheManifest
    device: Literal["cpu", "cuda"]
    step_impl: str
    inputs: Annotated[list[InputSpec], LimitedItems] = Field(min_length=1)
    #: every range bounded (an int max, never null): admission bounds each dynamic size by it
    symbols: Annotated[dict[str, SymbolRange], LimitedItems] = Field(default_factory=dict)
    torch_version: str
    model: str = ""
    model_args: Annotated[dict[str, str | int | float | bool | None], LimitedItems] = Field(default_factory=dict)
    model_dtype: str | None = None
    #: the input carrying the step's absolute positions (None: computed inside the program)
    positions_input: int | None = Field(default=None, ge=0)
    #: export options that shaped the program (e.g. ``fuse_projections``, ``max_autotune``)
    options: Annotated[dict[str, bool | int | str], LimitedItems] = Field(default_factory=dict)
    #: the package also holds :data:`DECODE_METHOD`: the step specialized to one token
    decode_method: bool = False
    #: the package also holds :data:`SESSIONS_METHOD` (batched artifacts only)
    sessions_method: bool = False
    #: per model output of the general method, the dim that is the step's token width, when every
    #: output is per token along one (design section 4.3: a one-token step then runs the general
    #: program at width 2, its token repeated); None: not so, or not recorded (an earlier export)
    output_width_dims: Annotated[list[Annotated[int, Field(ge=0)]], LimitedItems] | None = None
    #: the weights stored quantized (design section 11); None: float weights
    quantization: QuantizationSpec | None = None

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
        # the program's inputs are one namespace: the model's, then the storage (named by the manifest)
        named: dict[str, str] = {s.name: "a storage input" for s in self.manifest.storage_inputs()}
        for i, inp in enumerate(self.inputs):
            if inp.name in named:
                raise ValueError(
                    f"input {i} is named {inp.name!r}, the name of {named[inp.name]}; every input of "
                    "the program needs a name of its own"
                )
            named[inp.name] = f"input {i}"
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
        if self.model_dtype is not None and self.model_dtype != self.manifest.storage_dtype:
            # export casts the model and its cache to one dtype; a check would compare against the
            # eager model in the recorded one, with that dtype's tolerance
            raise ValueError(
                f"model_dtype {self.model_dtype!r} disagrees with the cache's storage dtype "
                f"{self.manifest.storage_dtype!r}: an exported model computes and stores in one dtype"
            )
        for name, rng in self.symbols.items():
            if rng.max is None:
                raise ValueError(
                    f"symbol {name!r} has max null; a symbol's range must be bounded: an integer max >= "
                    f"min={rng.min}"
                )
        width_range = self.symbols.get(extent)
        if width_range is None:
            raise ValueError(f"the token width symbol {extent!r} has no range in symbols")
        if width_range.min < 1 or width_range.max > self.manifest.max_write:
            raise ValueError(
                f"the token width range [{width_range.min}, {width_range.max}] must lie in "
                f"[1, max_write={self.manifest.max_write}]"
            )
        for inp in self.inputs:
            for size in inp.shape:
                if isinstance(size, str) and size not in self.symbols:
                    raise ValueError(f"input {inp.name!r} uses the symbol {size!r}, which has no range")
        if self.sessions_method and self.manifest.paging is None:
            raise ValueError("sessions_method is true, but the manifest has no paging: only a batched artifact has that method")
        if self.positions_input is not None:
            if self.positions_input >= n:
                raise ValueError(f"positions_input {self.positions_input} is not one of the {n} inputs")
            positions = self.inputs[self.positions_input]
            if positions.dtype != "int64" or extent not in positions.shape:
                raise ValueError(
                    f"positions input {positions.name!r} must be int64 with the token width "
                    f"{extent!r} among its dims, got {positions.dtype} {positions.shape}"
                )
        return self

    @property
    def methods(self) -> list[str]:
        """The compiled programs the package holds, by AOTI model name."""
        return [STEP_METHOD] + [DECODE_METHOD] * self.decode_method + [SESSIONS_METHOD] * self.sessions_method

    def program_description(self, method: str = STEP_METHOD) -> str:
        """What the compiled ``method`` must agree with, as canonical JSON: the inputs, their
        symbols and ranges, the step width and the positions input. In the decode method the
        width symbol is the constant 1; the sessions method takes what the general step takes."""
        data = self.model_dump(mode="json", include={"inputs", "symbols", "step_width", "positions_input"})
        if self.output_width_dims is not None and method in (STEP_METHOD, SESSIONS_METHOD):  # absent before it was recorded
            data["output_width_dims"] = list(self.output_width_dims)
        if method == DECODE_METHOD:
            width = self.width_symbol
            for inp in data["inputs"]:
                inp["shape"] = [1 if size == width else size for size in inp["shape"]]
            del data["symbols"][width]
        elif method not in (STEP_METHOD, SESSIONS_METHOD):
            raise SpecError(f"unknown method {method!r}; expected one of {[STEP_METHOD, DECODE_METHOD, SESSIONS_METHOD]}")
        data["method"] = method
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def width_symbol(self) -> str:
        spec = self.step_width
        return str(self.inputs[spec.input_index].shape[spec.dim])

    @property
    def general_min_width(self) -> int:
        """The fewest tokens the general program was compiled for: 2 where its width is dynamic
        (AOTInductor compiles a dynamic dim from 2 up, design section 4.3), else 1."""
        width = self.symbols.get(self.width_symbol)  # None: a static width
        return 2 if width is not None and width.max >= 2 else 1

    @property
    def pads_one_token(self) -> bool:
        """Whether a ``.pt2`` runtime runs a one-token step through the general program at width 2,
        its token repeated (design section 4.3): no decode method, the general program starts at 2,
        the runtime owns the positions and every output is per token (``output_width_dims``). A
        batched artifact's runner pads with its scratch token instead."""
        return (
            not self.decode_method
            and self.general_min_width == 2
            and self.output_width_dims is not None
            and self.positions_input is not None
            and self.manifest.paging is None
        )


def parse_artifact_specs(text: str | bytes, source: str = "artifact") -> ArtifactSpecs:
    data = loads_limited(text, f"{source}: offgraph specs entry", ArtifactError, max_values=MAX_SPEC_VALUES)
    try:
        return ArtifactSpecs.model_validate(data, strict=True)  # no "256" or 1.0 or true for an int
    except (ValidationError, SpecError) as exc:
        raise ArtifactError(f"{source}: invalid offgraph specs: {exc}") from exc


SPECS_ENTRY = "extra/offgraph_specs.json"


def read_artifact_specs(path: str | os.PathLike, verify_crc: bool = False) -> ArtifactSpecs:
    """Read the specs of a ``.pt2`` package from its archive, without loading compiled code. The
    archive's entries are checked first (:func:`~offgraph_export.specs.archive.check_archive`: names,
    the one canonical layout, so what is read here is what torch's loader would read, and the
    bounds on counts and sizes; ``verify_crc`` also reads every member to verify its checksum)."""
    source = str(path)
    infos = {info.filename: info for info in check_archive(path, verify_crc=verify_crc)}
    entry = archive_root(list(infos), source) + SPECS_ENTRY
    if entry not in infos:
        raise ArtifactError(
            f"{source} has no offgraph specs ({SPECS_ENTRY}); was it built by "
            "`offgraph-export export`?"
        )
    if infos[entry].file_size > MAX_JSON_BYTES:
        raise ArtifactError(
            f"{source}: {SPECS_ENTRY} is {infos[entry].file_size} bytes; more than the "
            f"{MAX_JSON_BYTES} a spec may hold"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            text = archive.read(entry)
    except (OSError, *UNREADABLE_MEMBER) as exc:
        raise ArtifactError(f"{source}: cannot read {SPECS_ENTRY}: {type(exc).__name__}: {exc}") from exc
    return parse_artifact_specs(text, source)


def write_artifact_specs(path: str | os.PathLike, specs: ArtifactSpecs) -> None:
    """Add the specs entry to an existing ``.pt2`` archive."""
    with zipfile.ZipFile(path, "a") as archive:
        entry = archive_root(archive.namelist(), str(path)) + SPECS_ENTRY
        archive.writestr(entry, specs.model_dump_json(indent=2))


def archive_entries(path: str | os.PathLike) -> list[tuple[str, int]]:
    """Each entry's name and declared size, from an archive that passes
    :func:`~offgraph_export.specs.archive.check_archive` (its layout and bounds; no member is read)."""
    return [(info.filename, info.file_size) for info in check_archive(path, verify_crc=False)]
