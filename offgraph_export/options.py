"""Export options, typed once: their vocabularies, their per-device defaults and every rule on
which go together.

:class:`ExportOptions` is what a user asks for (``None``: the device's default); :meth:`ExportOptions.resolve`
fills the defaults and applies every compatibility rule, raising :class:`OptionError` (an
:class:`~offgraph_export.errors.ExportError`) that names the flag; the result,
:class:`ResolvedOptions`, is what the pipeline runs with and what the specs record
(:meth:`ResolvedOptions.record`). The CLI and the Python API go through the same :meth:`resolve`,
so both refuse the same combinations with the same words, before anything is traced.

This module imports neither torch nor triton: the CLI reads its ``click.Choice`` lists from here
when it starts. Nothing else computes a per-device export default or a compatibility rule.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from offgraph_export.errors import ExportError
from offgraph_export.specs.quantization import (
    DEFAULT_GROUP_SIZE, GROUP_SIZES, GROUPED_SCHEMES, LM_HEAD_CHOICES, PT2_SCHEMES, PTE_SCHEMES, QUANT_SCHEMES,
)

__all__ = [
    "FORMATS",
    "DEVICES",
    "STEP_IMPLS",
    "BACKENDS",
    "BACKEND_DEVICE",
    "AUTOTUNE_CHOICES",
    "QUANTIZE_CHOICES",
    "LM_HEAD_CHOICES",
    "GROUP_SIZES",
    "OptionError",
    "ExportOptions",
    "ResolvedOptions",
    "device_kind",
    "default_step_impl",
    "default_decode_method",
    "default_max_autotune",
    "default_decode_gemv",
    "default_decode_rope",
    "pass_record",
    "lowering_record",
]

Format = Literal["pt2", "executorch"]
#: ``pt2``: an AOTInductor package (a method per program); ``executorch``: an ExecuTorch ``.pte``.
FORMATS: tuple[str, ...] = get_args(Format)
#: The devices a CLI user picks from (the API also takes ``cuda:N``).
DEVICES = ("cpu", "cuda")
StepImplName = Literal["portable", "triton"]
#: The lowered step implementations by name (``kernels/step_impls.py`` maps them to code).
STEP_IMPLS: tuple[str, ...] = get_args(StepImplName)
Backend = Literal["xnnpack", "portable", "cuda"]
#: What lowers a ``.pte``'s ops: ExecuTorch's portable kernels alone, XNNPACK where it applies
#: (both cpu), or the CUDA delegate (the whole program, compiled by AOTInductor).
BACKENDS: tuple[str, ...] = get_args(Backend)
#: The device each backend's program runs on.
BACKEND_DEVICE = {"xnnpack": "cpu", "portable": "cpu", "cuda": "cuda"}
Autotune = Literal["none", "decode", "all"]
#: ``max_autotune`` values: which methods' GEMMs inductor tunes by benchmarking candidates on the
#: device at compile time (slower compile, faster small-batch GEMMs).
AUTOTUNE_CHOICES: tuple[str, ...] = get_args(Autotune)

Quantize = Literal["none", "int8", "int4", "8da4w"]
#: ``--quantize`` values: float weights, or every linear's weight stored as int8 / int4 (weight-only,
#: a ``.pt2``), or torchao's 8da4w (int8 dynamic activations, int4 weights: a ``.pte`` delegated to
#: XNNPACK) (design section 11; the schemes are ``specs/quantization.py``'s)
QUANTIZE_CHOICES: tuple[str, ...] = get_args(Quantize)
assert QUANTIZE_CHOICES[1:] == QUANT_SCHEMES
LmHead = Literal["int8", "int4", "none"]
#: ``--quantize-lm-head`` values (``specs/quantization.py``'s): the lm_head's own weight-only scheme,
#: or ``none`` to leave it float; not given, the lm_head takes the ``--quantize`` scheme
assert get_args(LmHead) == LM_HEAD_CHOICES

_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")


class OptionError(ExportError):
    """Options that do not go together (or a value outside an option's vocabulary). ``flag``:
    the CLI flag of the option at fault (``--decode-gemv``), for the CLI's usage error."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


def device_kind(device: str) -> str:
    """``cuda`` for ``cuda`` and ``cuda:N``, ``cpu`` otherwise."""
    return "cuda" if device.startswith("cuda") else "cpu"


def default_step_impl(device: str) -> str:
    """``triton`` on cuda (reads only the valid rows), ``portable`` elsewhere."""
    return "triton" if device_kind(device) == "cuda" else "portable"


def default_decode_method(device: str) -> bool:
    """A decode method by default on cuda (where a specialized one-token step pays for its
    compile); on cpu the general step serves decode."""
    return device_kind(device) == "cuda"


def default_max_autotune(device: str) -> str:
    """``decode`` on cuda (tune the one-token GEMMs, which default kernels run far below memory
    bandwidth), ``none`` on cpu."""
    return "decode" if device_kind(device) == "cuda" else "none"


def default_decode_gemv(device: str, decode_method: bool) -> bool:
    """GEMV projections with their folds in the decode method: on wherever they can run, a cuda
    decode method (measured faster than the compiler's GEMMs there, ``benchmarks/README.md``)."""
    return decode_method and device_kind(device) == "cuda"


def default_decode_rope(device: str, decode_method: bool, step_impl: str) -> bool:
    """The rotary fold: on wherever it can run, the triton step's one-token kernel of a cuda decode
    method (the pass leaves a model whose rotary form it does not recognize unchanged)."""
    return default_decode_gemv(device, decode_method) and step_impl == "triton"


def default_decode_sessions(step_impl: str) -> bool:
    """The sessions method of a batched artifact: on where its rewrite changes the kernels, the
    triton paged step (the portable step's calls are aten ops: the method would compute the same
    thing the same way)."""
    return step_impl == "triton"


#: the CLI flag of each field, named in errors
_FLAGS = {
    "format": "--format",
    "device": "--device",
    "executorch_backend": "--executorch-backend",
    "step_impl": "--step-impl",
    "fuse_projections": "--fuse-projections",
    "decode_method": "--decode-method",
    "max_autotune": "--max-autotune",
    "decode_gemv": "--decode-gemv",
    "decode_rope": "--decode-rope",
    "decode_sessions": "--decode-sessions",
    "quantize": "--quantize",
    "group_size": "--group-size",
    "quantize_lm_head": "--quantize-lm-head",
}


class ResolvedOptions(BaseModel):
    """Every option concrete: what the passes and the lowering run with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Format
    #: the device the artifact runs on (``cuda`` for a ``.pte`` of the CUDA delegate)
    device: str
    executorch_backend: Backend | None
    step_impl: StepImplName
    fuse_projections: bool
    decode_method: bool
    max_autotune: Autotune
    decode_gemv: bool
    decode_rope: bool
    #: a batched artifact's method for decode-only steps (``passes/decode_sessions.py``)
    decode_sessions: bool = False
    #: weight-only quantization of every linear (``passes/quantize_weights.py``)
    quantize: Quantize = "none"
    #: int4's and 8da4w's input features per scale and zero (None where no weight is grouped)
    group_size: int | None = None
    #: the lm_head's scheme where it is not ``quantize``'s (``none``: left float); None: ``quantize``'s
    quantize_lm_head: LmHead | None = None

    @property
    def export_device(self) -> str:
        """Where the model is traced: the target device for a ``.pt2``; always the cpu for a
        ``.pte`` (ExecuTorch's CUDA backend moves the program to the device itself)."""
        return self.device if self.format == "pt2" else "cpu"

    def record(self) -> dict[str, bool | int | str]:
        """The options the specs record (``ArtifactSpecs.options``, shown by ``inspect``)."""
        return pass_record(
            self.fuse_projections, self.decode_method, self.decode_gemv, self.decode_rope, self.decode_sessions,
            self.quantize, self.group_size, self.quantize_lm_head,
        ) | lowering_record(self.format, self.max_autotune)


def pass_record(
    fuse: bool, decode_method: bool, decode_gemv: bool, decode_rope: bool, decode_sessions: bool = False,
    quantize: str = "none", group_size: int | None = None, quantize_lm_head: str | None = None,
) -> dict[str, bool | int | str]:
    """The part of the specs' options the passes decide: the fold flags only where there is a
    decode method to fold into; ``decode_sessions`` only where it is on (a batched artifact's);
    ``quantize`` (and the ``group_size`` of grouped weights) only where weights are quantized;
    ``quantize_lm_head`` only where it is not ``quantize``."""
    out: dict[str, bool | int | str] = {"fuse_projections": fuse}
    if decode_method:
        out |= {"decode_gemv": decode_gemv, "decode_rope": decode_rope}
    if decode_sessions:
        out["decode_sessions"] = True
    if quantize != "none":
        out["quantize"] = quantize
        if group_size is not None:
            out["group_size"] = group_size
        if quantize_lm_head is not None:
            out["quantize_lm_head"] = quantize_lm_head
    return out


def lowering_record(format: str, max_autotune: str) -> dict[str, bool | int | str]:
    """The part the lowering decides: the autotune mode, for a ``.pt2`` only."""
    return {"max_autotune": max_autotune} if format == "pt2" else {}


class ExportOptions(BaseModel):
    """What a user asks of an export; ``None``: the device's default (:meth:`resolve`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Format = "pt2"
    device: str = "cpu"
    executorch_backend: Backend | None = None
    step_impl: StepImplName | None = None
    fuse_projections: bool = True
    decode_method: bool | None = None
    max_autotune: Autotune | None = None
    decode_gemv: bool | None = None
    decode_rope: bool | None = None
    decode_sessions: bool | None = None
    quantize: Quantize = "none"
    group_size: int | None = None
    quantize_lm_head: LmHead | None = None

    @classmethod
    def parse(cls, **fields: Any) -> "ExportOptions":
        """Build from keyword values, refusing an unknown option or a value outside its
        vocabulary with one :class:`OptionError` naming the option and what it takes."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "?"
            if err["type"] == "extra_forbidden":
                raise OptionError(f"unknown export option {name!r}; expected one of {tuple(cls.model_fields)}", "--help") from None
            raise OptionError(
                f"{name}={err.get('input')!r} is not valid: {err['msg']}", _FLAGS.get(name, "--help")
            ) from None

    def resolve(
        self, max_write: int | None = None, batched: bool | None = None, dtype: str | None = None,
    ) -> ResolvedOptions:
        """The device's defaults filled in and every rule checked. ``max_write``: the cache's
        step bound, when known (the token width must range over at least ``[1, 2]``);
        ``batched``: whether the cache is paged (``--max-sessions``), when known; ``dtype``: the
        dtype the model is cast to (``--dtype``), when known (8da4w takes float32 only)."""
        if not _DEVICE.fullmatch(self.device):
            raise OptionError(f"unknown device {self.device!r}; expected cpu, cuda or cuda:N", "--device")
        pt2 = self.format == "pt2"
        kind = device_kind(self.device)
        backend = self.executorch_backend
        if pt2 and backend is not None:
            raise OptionError(f"executorch_backend {backend!r} applies to the executorch format, not pt2", "--executorch-backend")
        if not pt2:
            backend = backend or ("cuda" if kind == "cuda" else "xnnpack")
            if BACKEND_DEVICE[backend] != kind:
                raise OptionError(f"the {backend} backend builds for {BACKEND_DEVICE[backend]}, not {kind}", "--executorch-backend")
            if self.decode_method or self.max_autotune not in (None, "none"):
                raise OptionError(
                    "--decode-method and --max-autotune are AOTInductor options; drop them for --format executorch",
                    "--format",
                )
        if self.step_impl == "triton" and kind == "cpu":
            raise OptionError("the triton step runs on cuda only; use --step-impl portable (the cpu default)", "--step-impl")
        export_device = self.device if pt2 else "cpu"
        step_impl = self.step_impl or default_step_impl(export_device)
        decode_method = self.decode_method if self.decode_method is not None else pt2 and default_decode_method(self.device)
        gemv_ok = pt2 and default_decode_gemv(self.device, decode_method)
        if self.decode_gemv and not gemv_ok:
            raise OptionError(
                "--decode-gemv is a cuda kernel for the pt2 decode method: use it with --device cuda "
                "and without --no-decode-method",
                "--decode-gemv",
            )
        rope_ok = pt2 and default_decode_rope(self.device, decode_method, step_impl)
        if self.decode_rope and not rope_ok:
            raise OptionError(
                "--decode-rope folds the rotary embedding into the triton step's one-token kernel: use "
                "it with --device cuda, the triton step and without --no-decode-method",
                "--decode-rope",
            )
        if not pt2 and step_impl == "triton":
            raise OptionError("the executorch format exports on cpu with the portable step; drop --step-impl triton", "--step-impl")
        max_autotune = self.max_autotune or (default_max_autotune(self.device) if pt2 and decode_method else "none")
        if max_autotune == "decode" and not decode_method:
            raise OptionError(
                "max_autotune='decode' tunes the decode method, which this program leaves out; use 'all' or 'none'",
                "--max-autotune",
            )
        if self.decode_sessions and not pt2:
            raise OptionError("--decode-sessions is a method of a .pt2 batched artifact; drop it for --format executorch", "--decode-sessions")
        if self.decode_sessions and batched is False:
            raise OptionError(
                "--decode-sessions adds the batched artifact's method for decode steps of several sessions: "
                "use it with --max-sessions N",
                "--decode-sessions",
            )
        decode_sessions = (
            self.decode_sessions if self.decode_sessions is not None
            else bool(batched) and pt2 and default_decode_sessions(step_impl)
        )
        lm_head = self._lm_head()
        group_size = self._group_size(pt2, backend, dtype, lm_head)
        if max_write is not None and max_write < 2:  # a width range [1, 1] is a constant to torch.export
            raise OptionError(f"max_write {max_write} is too small: a step's token width must range over at least [1, 2]", "--max-write")
        return ResolvedOptions(
            format=self.format,
            device=self.device,
            executorch_backend=backend,
            step_impl=step_impl,  # type: ignore[arg-type]
            fuse_projections=self.fuse_projections,
            decode_method=decode_method,
            max_autotune=max_autotune,  # type: ignore[arg-type]
            decode_gemv=self.decode_gemv if self.decode_gemv is not None else gemv_ok,
            decode_rope=self.decode_rope if self.decode_rope is not None else rope_ok,
            decode_sessions=decode_sessions,
            quantize=self.quantize,
            group_size=group_size,
            quantize_lm_head=lm_head,  # type: ignore[arg-type]
        )

    def _lm_head(self) -> str | None:
        """The lm_head's own scheme: None where not given or the same as ``--quantize``'s; refused
        without a weight-only ``--quantize`` (there is no scheme for it to differ from)."""
        head = self.quantize_lm_head
        if head is None or head == self.quantize:
            return None
        if self.quantize not in PT2_SCHEMES:
            raise OptionError(
                f"--quantize-lm-head {head} sets the lm_head's scheme within a weight-only export: use it with "
                f"--quantize {' or '.join(PT2_SCHEMES)}, not {'no --quantize' if self.quantize == 'none' else '--quantize ' + self.quantize}",
                "--quantize-lm-head",
            )
        return head

    def _group_size(self, pt2: bool, backend: str | None, dtype: str | None, lm_head: str | None = None) -> int | None:
        """The group size of int4 and 8da4w weights, the lm_head's among them (its default where not
        given); refuses one where no weight is grouped, and a scheme the format does not take (design section 11): int8/int4 for a
        ``.pte`` (XNNPACK computes weight-only programs wrongly), 8da4w for a ``.pt2``, on a
        backend other than XNNPACK, or with a dtype other than float32."""
        q = self.quantize
        if q in PT2_SCHEMES and not pt2:
            raise OptionError(
                f"--quantize {q} is weight-only quantization for a .pt2: ExecuTorch's XNNPACK computed weight-only "
                f"int4 and int8 programs wrongly (outputs 130x and 2000x off), so a .pte takes --quantize "
                f"{' or '.join(PTE_SCHEMES)} (or none), or use --format pt2",
                "--quantize",
            )
        if q in PTE_SCHEMES:
            if pt2:
                raise OptionError(
                    f"--quantize {q} (int8 dynamic activations, int4 weights) is lowered by ExecuTorch's XNNPACK "
                    f"for a .pte; a .pt2 takes --quantize {' or '.join(PT2_SCHEMES)} (or none), or use --format executorch",
                    "--quantize",
                )
            if backend != "xnnpack":
                raise OptionError(
                    f"--quantize {q} runs its linears in XNNPACK's dynamically quantized kernels; the {backend} "
                    "backend has none: use --executorch-backend xnnpack (the cpu default)",
                    "--executorch-backend",
                )
            if dtype is not None and dtype != "float32":
                raise OptionError(
                    f"--quantize {q} takes a float32 model, not --dtype {dtype}: ExecuTorch does not delegate {dtype} "
                    "dynamically quantized linears to XNNPACK and has no portable kernels for them",
                    "--quantize",
                )
        if q not in GROUPED_SCHEMES and lm_head not in GROUPED_SCHEMES:
            if self.group_size is not None:
                raise OptionError(
                    f"--group-size {self.group_size} applies to --quantize {' or '.join(GROUPED_SCHEMES)} "
                    "(or --quantize-lm-head int4) only", "--group-size"
                )
            return None
        if self.group_size is None:
            return DEFAULT_GROUP_SIZE
        if self.group_size not in GROUP_SIZES:
            raise OptionError(f"--group-size {self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}", "--group-size")
        return self.group_size
