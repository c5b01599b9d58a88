"""What an artifact records of its quantized weights (design section 11): the scheme, the group
size and, per quantized weight, its name in the program, the model's parameters it was made of,
its float shape and whether other nodes read the float weight too.

Read from untrusted specs like every other entry: every field is bounded and checked here, and
the rules that tie them together (a group size only for ``int4`` and ``8da4w``, a ``K`` the group size divides,
unique names) are checked when the specs are parsed, so ``check``'s oracle never acts on a record
it could not have come from an export. The vocabularies (``QUANT_SCHEMES``, ``GROUP_SIZES``) are
defined here, once; ``options.py`` and the CLI read them from here. No torch.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from offgraph_export.specs.limits import LimitedItems

__all__ = ["QUANT_SCHEMES", "GROUPED_SCHEMES", "PT2_SCHEMES", "PTE_SCHEMES", "GROUP_SIZES", "DEFAULT_GROUP_SIZE", "QuantizedWeight", "QuantizationSpec", "group_problem",
           "LM_HEAD_CHOICES"]

QuantScheme = Literal["int8", "int4", "8da4w"]
#: the schemes one weight of a ``.pt2`` may take apart from the spec's (``--quantize-lm-head``)
WeightScheme = Literal["int8", "int4"]
#: ``int8``: symmetric per output channel; ``int4``: asymmetric per group of input features (both
#: weight-only, ``.pt2``); ``8da4w``: torchao's int8 dynamic per-token activations and symmetric
#: int4 weights per group of input features (``.pte``, delegated to XNNPACK; design section 11).
QUANT_SCHEMES: tuple[str, ...] = get_args(QuantScheme)
#: the schemes whose weights are quantized in groups of input features
GROUPED_SCHEMES: tuple[str, ...] = ("int4", "8da4w")
#: the schemes a ``.pt2`` takes (weight-only) and the ones a ``.pte`` takes
PT2_SCHEMES: tuple[str, ...] = ("int8", "int4")
PTE_SCHEMES: tuple[str, ...] = ("8da4w",)
#: ``--quantize-lm-head`` values: the lm_head's own weight-only scheme, or ``none`` (left float)
LM_HEAD_CHOICES: tuple[str, ...] = (*get_args(WeightScheme), "none")
#: the group sizes ``int4`` and ``8da4w`` take (input features per scale and zero)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128

_Name = Annotated[str, Field(min_length=1, max_length=512)]


def group_problem(name: str, k: int, group_size: int, scheme: str = "int4") -> str | None:
    """Why a weight of ``k`` input features cannot take ``scheme``'s groups of ``group_size``
    (None: it can), naming the group sizes that would divide it."""
    if k % group_size == 0 and k % 2 == 0:
        return None
    fits = [g for g in GROUP_SIZES if k % g == 0]
    hint = f"use --group-size {' or '.join(map(str, fits))}" if fits else f"no group size in {GROUP_SIZES} divides it"
    return f"weight {name} has {k} input features, not a multiple of the {scheme} group size {group_size}; {hint}"


class QuantizedWeight(BaseModel):
    """One quantized weight: ``name`` in the program, ``sources`` the model's parameters it was
    made of (one, or the fused ones in row order), ``shape`` its float ``[N, K]``, ``shared`` when
    other nodes read the float weight too (a tied embedding table), ``scheme`` where it is not the
    spec's (the lm_head of ``--quantize-lm-head``; :meth:`QuantizationSpec.scheme_of`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: _Name
    sources: Annotated[list[_Name], LimitedItems] = Field(min_length=1)
    shape: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=2)]
    shared: bool = False
    scheme: WeightScheme | None = None


class QuantizationSpec(BaseModel):
    """The ``quantization`` entry of the specs (absent: float weights)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheme: QuantScheme
    group_size: int | None = None
    weights: Annotated[list[QuantizedWeight], LimitedItems] = Field(min_length=1)

    def label(self, groups: bool = True) -> str:
        """Short: ``int8``, ``int4/128``, ``int4/32+lm_head:int8`` (the weights of another scheme);
        without the group sizes where not ``groups``."""
        def one(scheme: str) -> str:
            return f"{scheme}/{self.group_size}" if groups and scheme in GROUPED_SCHEMES else scheme

        own = sorted({w.scheme for w in self.weights if w.scheme is not None})
        return one(self.scheme) + "".join(f"+lm_head:{one(o)}" for o in own)

    def scheme_of(self, weight: QuantizedWeight) -> str:
        """The scheme ``weight`` is stored in: its own, else the spec's."""
        return weight.scheme or self.scheme

    def group_of(self, weight: QuantizedWeight) -> int | None:
        """``weight``'s group size: the spec's where its scheme is grouped, else None."""
        return self.group_size if self.scheme_of(weight) in GROUPED_SCHEMES else None

    @model_validator(mode="after")
    def _consistent(self) -> "QuantizationSpec":
        own = [w for w in self.weights if w.scheme is not None]
        if own and self.scheme not in PT2_SCHEMES:
            raise ValueError(f"a {self.scheme} spec stores every weight as {self.scheme}; a weight names its own scheme")
        if any(w.scheme == self.scheme for w in own):
            raise ValueError(f"weight {next(w.name for w in own if w.scheme == self.scheme)} names the spec's own scheme {self.scheme}")
        if len(own) > 1:
            raise ValueError(f"{len(own)} weights name their own scheme; only the lm_head does")
        grouped = [w for w in self.weights if self.scheme_of(w) in GROUPED_SCHEMES]
        if grouped:
            if self.group_size not in GROUP_SIZES:
                raise ValueError(f"{self.scheme_of(grouped[0])} group_size {self.group_size!r} is not one of {GROUP_SIZES}")
            for w in grouped:
                problem = group_problem(w.name, w.shape[1], self.group_size, self.scheme_of(w))
                if problem:
                    raise ValueError(problem)
        elif self.group_size is not None:
            raise ValueError(f"group_size {self.group_size} applies to {' and '.join(GROUPED_SCHEMES)} weights only; this spec has none")
        names = [w.name for w in self.weights]
        if len(set(names)) != len(names):
            raise ValueError("a quantized weight is named twice")
        sources = [s for w in self.weights for s in w.sources]
        if len(set(sources)) != len(sources):
            raise ValueError("a model parameter is the source of two quantized weights")
        return self
