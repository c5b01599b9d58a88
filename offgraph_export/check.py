"""Check compiled steps against their spec and against the eager oracle.

A check replays a scripted session (prefill in chunks, then decode) through the artifact and
through the eager model over reference caches (same weights), and after every step asserts:
  * outputs match within the dtype's tolerance;
  * the storage rows that changed are exactly the rows of positions ``[used, used + width)``
    (flat: row = position, ring: position mod rows); every other row is bit-identical, and flat
    rows past the history, poisoned with NaN before the step, are still NaN;
  * the written rows hold the oracle's K/V for those positions;
  * the width read from the spec equals the number of rows written.
After the first step it checks that the manifest matches the layers the eager model really has
(the compiled program's inputs were checked against the specs when the artifact loaded). The default script crosses two growth boundaries and wraps
every ring layer. The result is a :class:`CheckReport`; :func:`assert_artifact_matches` raises
:class:`CheckFailed` carrying it, so a CI lowering check is one line in pytest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from offgraph_export.errors import CheckFailed, OffgraphError, first_line
from offgraph_export.frontends import load_bundle
from offgraph_export.frontends.torchao_weights import oracle_split
from offgraph_export.models import ModelBundle, cast_bundle
from offgraph_export.reference.oracle import HeldRows, Oracle
from offgraph_export.reference.upcast import HALF_DTYPES, REFERENCE_MULTIPLIER, Float32Twin, reference_errors
from offgraph_export.reference.weight_quant import dequantized_weights
from offgraph_export.runtime import load_artifact
from offgraph_export.runtime.program import LoadedProgram
from offgraph_export.runtime.session import Session
from offgraph_export.specs.artifact import STEP_METHOD, ArtifactSpecs
from offgraph_export.specs.manifest import CacheManifest, LayerManifest, paged_row, ring_rows, storage_row
from offgraph_export.specs.quantization import PT2_SCHEMES, PTE_SCHEMES

__all__ = [
    "StepReport",
    "CheckReport",
    "default_schedule",
    "check_artifact",
    "assert_artifact_matches",
    "check_batched",
    "TOLERANCES",
    "QUANTIZED_TOLERANCES",
    "MAX_CHECK_STEPS",
]

#: the most steps (decode steps, prefill chunks, batched steps) a check runs: a ring-only artifact
#: bounds no schedule by its capacity, and every step runs the model eagerly too
MAX_CHECK_STEPS = 100_000

# (atol, rtol) on outputs, by the dtype the model computes in.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (6e-2, 6e-2),
}
#: (atol, rtol) on outputs and stored rows, by quantization scheme, where the program quantizes
#: activations at run time (design section 11, "8da4w for .pte"): XNNPACK rounds an activation
#: that lies within ~1e-6 of a rounding midpoint the other way from torchao's eager code, one
#: quantum of that token's input, and the difference propagates through the later layers.
QUANTIZED_TOLERANCES = {"8da4w": (1e-4, 1e-1)}


class StepReport(BaseModel):
    index: int
    kind: str
    start: int
    width: int
    width_from_spec: int
    #: the compiled method that ran the step (``model``: the general step; ``decode``; ``sessions``)
    method: str = ""
    #: a batched check: the session (its join number) whose tokens these were, and the step's
    #: tokens over all sessions
    session: int | None = None
    step_tokens: int | None = None
    rows_written: dict[str, list[int]] = Field(default_factory=dict)
    max_abs_err: float = 0.0
    tolerance: float = 0.0
    storage_max_err: float = 0.0
    grew_to: int | None = None
    problems: list[str] = Field(default_factory=list)
    #: comparisons over the fixed tolerance that passed by the float32 reference (design section 6)
    by_reference: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class CheckReport(BaseModel):
    artifact: str
    model: str
    device: str
    seed: int
    schedule: list[int]
    passed: bool = False
    problems: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    growths: int = 0
    ring_wraps: dict[str, bool] = Field(default_factory=dict)
    steps: list[StepReport] = Field(default_factory=list)
    #: a batched check: sessions joined in all, and pages crossed within some session's step
    sessions: int | None = None
    page_crossings: int = 0

    def render(self) -> str:
        from offgraph_export.specs.text import safe_text

        lines = [
            f"check {self.artifact} against {self.model or 'the eager model'} on {self.device}: "
            + ("PASSED" if self.passed else "FAILED"),
            f"  schedule (tokens per step): {self.schedule}",
            f"  growths: {self.growths}; ring wraps: "
            + (", ".join(f"layer {k}: {'yes' if v else 'no'}" for k, v in self.ring_wraps.items()) or "none"),
        ]
        if self.sessions is not None:
            lines.insert(2, f"  sessions: {self.sessions} joined; page crossings: {self.page_crossings}")
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        batched = self.sessions is not None
        lines.append("  step " + ("sess " if batched else "") + "kind     start width spec  method    max|err|    tol       storage  grew")
        for s in self.steps:
            mark = "ok  " if s.ok else "FAIL"
            grew = str(s.grew_to) if s.grew_to else ""
            sess = f"{s.session:<4d} " if batched and s.session is not None else ""
            lines.append(
                f"  {mark} {s.index:<3d} {sess}{s.kind:<7s} {s.start:5d} {s.width:5d} {s.width_from_spec:4d}  "
                f"{s.method:<8s} {s.max_abs_err:9.2e} {s.tolerance:9.2e} {s.storage_max_err:9.2e}  {grew}"
            )
            lines += [f"       - {p}" for p in s.problems]
            lines += [f"       ~ {p}" for p in s.by_reference]
        # the artifact's path, the model and problems quoting the specs are untrusted text: no line
        # shows a control character (a CR and a forged "PASSED" line, a terminal title, ...)
        return "\n".join(safe_text(line) for line in lines)


def default_schedule(
    manifest: CacheManifest, decode_steps: int = 16, prefill_chunks: int = 3, seed: int = 0
) -> list[int]:
    """Chunked prefill then ``decode_steps`` single tokens, long enough to cross two growth
    boundaries and wrap every ring layer (bounded by max capacity)."""
    rng = random.Random(seed)
    needed = decode_steps + prefill_chunks
    if manifest.has_flat:
        needed = max(needed, 2 * manifest.initial_capacity + 2)
    for layer in manifest.layers:
        if layer.window is not None:
            needed = max(needed, ring_rows(layer.window, manifest.max_write) + 2)
    needed = min(needed, manifest.max_capacity) if manifest.has_flat else needed
    prefill = max(prefill_chunks, needed - decode_steps)
    chunks = max(prefill_chunks, -(-prefill // manifest.max_write))
    cuts = sorted(rng.sample(range(1, prefill), chunks - 1)) if chunks > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, prefill])]
    if any(s > manifest.max_write for s in sizes):  # fall back to even chunks
        sizes = [prefill // chunks + (1 if i < prefill % chunks else 0) for i in range(chunks)]
    decode = [1] * max(0, min(decode_steps, manifest.max_capacity - prefill) if manifest.has_flat else decode_steps)
    return sizes + decode


# -- row comparison ----------------------------------------------------------------------------


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    same = (before == after) | (torch.isnan(before) & torch.isnan(after))
    changed = (~same).any(dim=3).any(dim=1).any(dim=0)
    return changed.nonzero().flatten().tolist()


def _rows_differ(written: list[int], expected: list[int], flat: bool) -> bool:
    """Whether the rows a step changed are not the rows of its tokens. A ring row may be rewritten
    with the very bytes it held (at layer 0 a value row is a function of the token alone, so a token
    that comes back one ring length later writes what is there): such a row reads as unchanged, and
    its values are compared with the oracle's like every row of the step. A flat row is always new
    (poisoned before it is written), so every one must change."""
    missing = set(expected) - set(written)
    return bool(set(written) - set(expected)) or (flat and bool(missing))


def _compare_rows(
    step: StepReport,
    manifest: CacheManifest,
    before: list[torch.Tensor],
    after: list[torch.Tensor],
    oracle: Oracle,
    tolerance: tuple[float, float],
    reference: Oracle | None = None,
) -> None:
    """Storage rows changed by the step are exactly the rows of its positions, and hold the
    oracle's K/V for those of them the oracle still holds (``reference``: the float32 oracle, a
    second chance for rows over the fixed tolerance); appends what differs to ``step.problems``."""
    positions = list(range(step.start, step.start + step.width))
    for storage, old, new in zip(manifest.storage_inputs(), before, after):
        layer, which = manifest.owner(storage)
        rows = new.shape[2]
        expected_rows = sorted({storage_row(p, rows) for p in positions})
        written = _changed_rows(old, new)
        step.rows_written[storage.name] = written
        if _rows_differ(written, expected_rows, flat=layer.window is None):
            step.problems.append(
                f"{storage.name}: rows written {_span(written)}, expected {_span(expected_rows)} "
                f"(positions {positions[0]}..{positions[-1]})"
            )
        if len(written) != step.width_from_spec and layer.window is None:
            step.problems.append(
                f"{storage.name}: spec width {step.width_from_spec} but {len(written)} rows written"
            )
        held = oracle.held(layer.layer_id)
        if not _rows_comparable(oracle, held, layer):
            continue  # its cache holds another form (a note of the report)
        kept = set(held[0]) if held else set()
        common = [p for p in positions if p in kept]
        if not common:
            step.problems.append(f"{storage.name}: the oracle holds none of positions {_span(positions)}")
            continue
        want = _held_rows(held, which, common)
        got = new[:, :, [storage_row(p, rows) for p in common]].float().to(want.device)
        _compare_stored(step, storage.name, got, want, tolerance, _reference_rows(reference, layer.layer_id, which, common))


def _reference_rows(reference: Oracle | None, layer_id: int, which: str, positions: list[int],
                    token_major: bool = False) -> Callable[[], torch.Tensor | None] | None:
    """The float32 oracle's rows for ``positions`` (:func:`_held_rows`), read only when asked: only
    a comparison over the fixed tolerance needs them."""
    if reference is None:
        return None
    return lambda: _held_rows(reference.held(layer_id), which, positions, token_major)


def _held_rows(held: HeldRows | None, which: str, positions: list[int], token_major: bool = False) -> torch.Tensor | None:
    """The K (``which`` "k") or V rows of ``held`` (an oracle's rows of a layer) for
    ``positions``, in float32, ``[B, Hkv, n, D]`` (``token_major``: batch 0's as ``[n, Hkv, D]``);
    None: nothing held, or not all of them."""
    if not held:
        return None
    index = {p: i for i, p in enumerate(held[0])}
    if any(p not in index for p in positions):
        return None
    rows = (held[1] if which == "k" else held[2])[:, :, [index[p] for p in positions]].float()
    return rows[0].transpose(0, 1) if token_major else rows


def _compare_stored(step: StepReport, name: str, got: torch.Tensor, want: torch.Tensor, tolerance: tuple[float, float],
                    reference: Callable[[], torch.Tensor | None] | None = None) -> None:
    """Stored rows ``got`` against the oracle's ``want`` (the output rule, the storage dtype's
    tolerance; ``reference``: gives the float32 oracle's rows, read only for a second chance)."""
    atol, rtol = tolerance
    err, scale, nonfinite = _difference(got, want)
    step.storage_max_err = max(step.storage_max_err, err)
    if nonfinite:
        step.problems.append(f"{name}: stored rows {nonfinite}")
    elif not err <= atol + rtol * scale:
        why = _second_chance(step, f"{name} rows", got, want, reference() if reference else None, tolerance)
        if why is not None:
            step.problems.append(f"{name}: stored rows differ from the oracle's K/V by {err:.3e}{why}")


def _second_chance(step: StepReport, what: str, got: torch.Tensor, want: torch.Tensor,
                   reference: torch.Tensor | None, tolerance: tuple[float, float]) -> str | None:
    """A half-precision comparison over the fixed tolerance, judged against the float32 oracle's
    ``reference`` (:func:`~offgraph_export.reference.upcast.reference_errors`): None when it passes
    that way (recorded in ``step.by_reference``), else the text its problem ends with."""
    if reference is None or reference.shape != want.shape:
        return ""
    errors = reference_errors(got, want, reference.to(want.device), tolerance)
    if errors.ok:
        step.by_reference.append(f"{what}: {errors.why_ok}; against the float32 run " + errors.describe())
        return None
    return f"; against the float32 run: {errors.problem} ({errors.describe()})"


def _difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, str]:
    """(largest difference over the elements where ``want`` is finite, the largest finite
    ``|want|``, a problem or ""): where ``want`` is inf or NaN, ``got`` must hold the same (an
    infinite reference would otherwise make a relative tolerance infinite, and any output pass)."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(want.isnan(), got.isnan()) or not torch.equal(
        got[~finite & ~want.isnan()], want[~finite & ~want.isnan()]
    ):
        return float("nan"), 0.0, "hold other non-finite values (inf, NaN) than the eager reference"
    if not finite.any():
        return 0.0, 0.0, ""
    return float((got[finite] - want[finite]).abs().max()), float(want[finite].abs().max()), ""


def _compare_outputs(step: StepReport, got: torch.Tensor, want: torch.Tensor, tolerance: tuple[float, float],
                     reference: torch.Tensor | None = None) -> None:
    atol, rtol = tolerance
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        step.problems.append(f"output shape {tuple(got.shape)} != eager {tuple(want.shape)}")
        return
    step.max_abs_err, scale, nonfinite = _difference(got, want)
    step.tolerance = atol + rtol * scale
    if nonfinite:
        step.problems.append(f"output values {nonfinite}")
    elif not step.max_abs_err <= step.tolerance:  # also catches NaN
        why = _second_chance(step, "output", got, want, reference, tolerance)
        if why is not None:
            step.problems.append(f"output differs from eager by {step.max_abs_err:.3e} > tolerance {step.tolerance:.3e}{why}")


def _other_form(held: HeldRows, layer: LayerManifest) -> tuple[int, int, int] | None:
    """``(heads, key dim, value dim)`` per position of the eager model's cache where that is not
    the geometry of the K/V the attention receives (the manifest's), else None. Multi-head latent
    attention (DeepSeek-V2/V3, MiniCPM3 in transformers 5) caches its compressed latent, one
    ``kv_lora_rank`` "key" and one rotary "value" per position, and expands it into per-head K/V
    every step: the artifact stores the expanded K/V the attention receives, so its rows cannot
    be compared with that cache (the outputs still are, at every step)."""
    _, keys, values = held
    got = (keys.shape[1], keys.shape[3], values.shape[3])
    return None if got == (layer.kv_heads, layer.head_dim, layer.v_head_dim) else got


def _check_manifest_model(oracle: Oracle, manifest: CacheManifest) -> tuple[list[str], list[str]]:
    """(problems, notes) of the manifest against what the eager model cached in its first step:
    a layer it never wrote is a problem, and so is one whose cache has other heads or head dims
    than the manifest, unless the oracle says its cache holds another form than the K/V the
    attention receives (``caches_other_form``: multi-head latent attention), which is a note (its
    rows are then left uncompared: :func:`_rows_comparable`)."""
    problems, notes = [], []
    for layer in manifest.layers:
        held = oracle.held(layer.layer_id)
        if held is None:
            problems.append(f"manifest layer {layer.layer_id}: the eager model never wrote this layer")
            continue
        other = _other_form(held, layer)
        if other is not None and getattr(oracle, "caches_other_form", False):
            notes.append(_form_note(layer, other))
        elif other is not None:
            problems.append(
                f"layer {layer.layer_id}: eager model writes (kv_heads, head_dim, v_head_dim)={other}, "
                f"manifest says {(layer.kv_heads, layer.head_dim, layer.v_head_dim)}"
            )
    return problems, notes


def _rows_comparable(oracle: Oracle, held: HeldRows | None, layer: LayerManifest) -> bool:
    """Whether the oracle's rows of ``layer`` are the K/V the artifact stores (or it holds none,
    which the comparison reports): not so where the oracle caches another form and its shapes
    show it."""
    return held is None or not (getattr(oracle, "caches_other_form", False) and _other_form(held, layer) is not None)


def _form_note(layer: LayerManifest, other: tuple[int, int, int]) -> str:
    return (
        f"layer {layer.layer_id}: the eager model caches (heads, key dim, value dim)={other} per position, "
        f"another form than the K/V its attention receives, {(layer.kv_heads, layer.head_dim, layer.v_head_dim)} "
        f"(a compressed latent, as multi-head latent attention caches): stored rows are not compared with that "
        f"cache; outputs are, at every step"
    )


# -- replay ------------------------------------------------------------------------------------


def _refuse_foreign_quantization(specs: ArtifactSpecs, path: str | Path) -> None:
    """The specs are untrusted: a quantization scheme the artifact's format never holds (8da4w in a
    ``.pt2``, int8/int4 in a ``.pte``) or 8da4w on a model not in float32 could not come from an
    export, and would pick an oracle and a tolerance of their own: refused before any step."""
    spec = specs.quantization
    if spec is None:
        return
    pte = str(path).endswith(".pte")
    allowed = PTE_SCHEMES if pte else PT2_SCHEMES
    if spec.scheme not in allowed:
        raise OffgraphError(
            f"{path}: its specs record {spec.scheme} weights, which a {'.pte' if pte else '.pt2'} never holds "
            f"(expected one of {', '.join(allowed)}): not an export's specs"
        )
    if spec.scheme == "8da4w" and specs.model_dtype not in (None, "float32"):
        raise OffgraphError(f"{path}: its specs record 8da4w weights on a {specs.model_dtype} model; 8da4w is float32 only")


def _tolerance(dtype: torch.dtype, specs: ArtifactSpecs | None = None) -> tuple[float, float]:
    scheme = specs.quantization.scheme if specs is not None and specs.quantization is not None else None
    if scheme in QUANTIZED_TOLERANCES:
        return QUANTIZED_TOLERANCES[scheme]
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


@contextmanager
def _oracle_weights(model: torch.nn.Module, specs: ArtifactSpecs, report: CheckReport) -> Iterator[None]:
    """The eager model with the artifact's weights for the block: where the artifact stores them
    quantized, each replaced by its dequantized values (design section 11) and put back after, so
    the tolerances stay the model dtype's and the caller's model is left as it was. Weights the
    model holds as torchao tensors stay as they are: torchao computes them (section 11)."""
    spec = specs.quantization
    if spec is None:
        yield
        return
    torchao, spec = oracle_split(model, spec)
    if torchao:
        report.notes.append(f"oracle: the eager model's {torchao} torchao-quantized weights as torchao computes them")
    if spec is None:
        yield
        return
    if spec.scheme == "8da4w":
        from offgraph_export.reference.quant_8da4w import quantized_8da4w_weights

        with quantized_8da4w_weights(model, spec) as replaced:
            report.notes.append(
                f"oracle: the eager model with torchao's 8da4w applied to the artifact's quantized weights "
                f"({len(spec.weights)} quantized weights, {replaced} model weights, groups of {spec.group_size}; "
                "activations quantized per token at every call)"
            )
            yield
        return
    with dequantized_weights(model, spec) as replaced:
        group = f", groups of {spec.group_size}" if spec.group_size else ""
        report.notes.append(
            f"oracle: the eager model with the artifact's {spec.label(groups=False)} weights dequantized "
            f"({len(spec.weights)} quantized weights, {replaced} model weights{group})"
        )
        yield


def _reference_step(twin: Float32Twin | None, oracle: Oracle | None, inputs: tuple) -> torch.Tensor | None:
    """The float32 oracle's first output for the step's ``inputs`` (upcast), run with the twin's
    weights; None without a twin."""
    if twin is None or oracle is None:
        return None
    with twin.active():
        return oracle.step(_upcast_inputs(inputs))[0]


def _float32_twin(model: torch.nn.Module, out_dtype: torch.dtype, wanted: bool | None, report: CheckReport) -> Float32Twin | None:
    """The float32 twin of a half-precision model for the reference oracle (design section 6), or
    None: ``wanted`` False, or None (auto) with a float32 model or one holding tensor subclasses
    (torchao's quantized weights, which run as torchao computes them)."""
    if wanted is False or (wanted is None and out_dtype not in HALF_DTYPES):
        return None
    if out_dtype not in HALF_DTYPES:
        raise OffgraphError(
            f"a float32 reference needs a bfloat16 or float16 model; this one computes in {out_dtype}: drop --float32-reference"
        )
    subclassed = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if type(p.data) is not torch.Tensor]
    if subclassed:
        if wanted:
            raise OffgraphError(
                f"no float32 reference for a model holding tensor subclasses ({subclassed[0]}); drop --float32-reference"
            )
        report.notes.append(f"no float32 reference: {len(subclassed)} weights are tensor subclasses (torchao)")
        return None
    twin = Float32Twin(model)
    report.notes.append(
        f"float32 reference: the eager model also runs with its {twin.tensors} {str(out_dtype).removeprefix('torch.')} "
        f"tensors upcast; a comparison over the fixed tolerance passes where the eager model misses it too, or the "
        f"artifact meets it, against that run, and the artifact is within {REFERENCE_MULTIPLIER:g}x the eager model's "
        "error against it (lines marked ~)"
    )
    return twin


def _upcast_inputs(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES else t for t in inputs)


def _replay(session: Session, bundle: ModelBundle, report: CheckReport, float32_reference: bool | None = None) -> None:
    """Run ``report.schedule`` step by step through the session and the eager model, appending a
    :class:`StepReport` per step; stops at the first step the runtime refuses or that raises.
    ``float32_reference``: run a float32 twin of a half-precision model beside it (None: auto)."""
    artifact = session.artifact
    manifest = artifact.specs.manifest
    spec = artifact.specs.step_width
    device = artifact.device
    model = bundle.model.to(device)
    out_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    out_tol = _tolerance(out_dtype, artifact.specs)
    storage_tol = _tolerance(getattr(torch, manifest.storage_dtype), artifact.specs)
    gen = torch.Generator().manual_seed(report.seed)
    tokens = torch.randint(
        0, bundle.vocab_size, (manifest.batch_size, sum(report.schedule)), generator=gen
    ).to(device)
    oracle = bundle.oracle(manifest)
    twin = _float32_twin(model, out_dtype, float32_reference, report)
    reference_oracle = bundle.oracle(manifest) if twin is not None else None
    with torch.no_grad():
        for index, width in enumerate(report.schedule):
            start = session.committed_length
            inputs = bundle.make_inputs(tokens[:, start : start + width], start)
            step = StepReport(
                index=index, kind="prefill" if width > 1 or index == 0 else "decode", start=start,
                width=width, width_from_spec=int(inputs[spec.input_index].shape[spec.dim]),
                method=artifact.method_for(width),
            )
            report.steps.append(step)
            growths_before = session.storage.growth_count
            try:
                prepared = session.prepare(inputs)
            except OffgraphError as exc:
                step.problems.append(f"step refused: {exc}")
                return
            if session.storage.growth_count != growths_before:
                step.grew_to = session.storage.capacity
            session.storage.poison_from(start)
            before = [t.clone() for t in session.storage.bound()]
            try:
                outputs = session.run(prepared)
            except Exception as exc:  # the compiled program failed: report, stop the replay
                step.problems.append(f"compiled step raised: {first_line(exc)}")
                return
            session.commit(prepared)
            expected = oracle.step(inputs)
            if index == 0:
                problems, notes = _check_manifest_model(oracle, manifest)
                report.problems += problems
                report.notes += notes
            _compare_outputs(step, outputs[0], expected[0], out_tol, _reference_step(twin, reference_oracle, inputs))
            _compare_rows(step, manifest, before, session.storage.bound(), oracle, storage_tol, reference_oracle)
            if step.width_from_spec != width:
                step.problems.append(f"spec width {step.width_from_spec} != tokens fed {width}")


# -- report ------------------------------------------------------------------------------------


def _conclude(report: CheckReport, session: Session) -> None:
    """Growths, ring wraps, notes and the verdict, once the replay is over."""
    manifest = session.specs.manifest
    report.growths = session.storage.growth_count
    for layer in manifest.layers:
        if layer.window is not None:  # wrapped: some position went to a row other than its own number
            report.ring_wraps[str(layer.layer_id)] = session.committed_length > ring_rows(layer.window, manifest.max_write)
    if manifest.has_flat and report.growths < 2:
        report.notes.append(f"the schedule crossed {report.growths} growth boundaries (wanted >= 2)")
    for lid, wrapped in report.ring_wraps.items():
        if not wrapped:
            report.notes.append(f"ring layer {lid} did not wrap")
    metrics = session.metrics()
    methods = sorted({s.method for s in report.steps})
    if len(methods) > 1:
        counts = {m: sum(s.method == m for s in report.steps) for m in methods}
        report.notes.append("methods: " + ", ".join(f"{m} ran {n} steps" for m, n in counts.items()))
    if metrics.graph_captures or metrics.graph_replays:
        report.notes.append(f"CUDA graphs: {metrics.graph_captures} captures, {metrics.graph_replays} replays")
    general_one = sum(s.width == 1 and s.method == STEP_METHOD for s in report.steps)
    if general_one and getattr(session.artifact, "pads_one_token", False):
        report.notes.append(
            f"{general_one} one-token steps ran the general program at width 2, the token repeated "
            "(it is compiled for 2 or more tokens)"
        )
    elif general_one and str(session.artifact.path).endswith(".pt2"):
        report.notes.append(
            f"{general_one} one-token steps ran the general program, compiled for 2 or more tokens (AOTInductor "
            "compiles a dynamic width from 2 up): checked here against the eager model; export with "
            "--decode-method for a program compiled for one token"
        )
    report.passed = (
        not report.problems
        and all(s.ok for s in report.steps)
        and len(report.steps) == len(report.schedule)
    )


def check_artifact(
    artifact: LoadedProgram | str | Path,
    bundle: ModelBundle | str,
    schedule: Sequence[int] | None = None,
    decode_steps: int = 16,
    prefill_chunks: int = 3,
    seed: int = 0,
    cuda_graphs: bool = False,
    float32_reference: bool | None = None,
) -> CheckReport:
    """Replay a session through ``artifact`` and the eager ``bundle``; never raises for a
    mismatch (see the report), only for unusable inputs. The session is closed on every path.
    ``float32_reference`` (None: on for a bfloat16/float16 model): a comparison over the fixed
    tolerance gets a second chance against a float32 run of the same weights (design section 6).
    A ``bundle`` named by reference is cast to the dtype the artifact's specs record for the model
    (``--dtype`` at export), as ``offgraph-export check`` does."""
    model_name = bundle if isinstance(bundle, str) else ""
    if isinstance(artifact, (str, Path)):
        artifact = load_artifact(artifact, single_threaded=cuda_graphs)
    if isinstance(bundle, str):
        bundle = cast_bundle(load_bundle(bundle), artifact.specs.model_dtype)
    manifest = artifact.specs.manifest
    for name, value in (("decode_steps", decode_steps), ("prefill_chunks", prefill_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHECK_STEPS:
            raise OffgraphError(f"{name}={value!r} must be an int in [1, {MAX_CHECK_STEPS}] (each step runs the model)")
    if manifest.has_flat and prefill_chunks > manifest.max_capacity:
        raise OffgraphError(
            f"prefill_chunks={prefill_chunks} cannot fit: the artifact holds at most "
            f"{manifest.max_capacity} tokens (max capacity)"
        )
    _refuse_foreign_quantization(artifact.specs, artifact.path)
    sched = list(schedule) if schedule is not None else default_schedule(manifest, decode_steps, prefill_chunks, seed)
    _check_schedule(sched, manifest)
    report = CheckReport(
        artifact=str(artifact.path), model=model_name or artifact.specs.model,
        device=str(artifact.device), seed=seed, schedule=sched,
    )
    session = Session(artifact, poison=True, cuda_graphs=cuda_graphs)
    try:
        with _oracle_weights(bundle.model.to(artifact.device), artifact.specs, report):
            _replay(session, bundle, report, float32_reference)
        _conclude(report, session)
    finally:
        session.close()
    return report


def _check_schedule(schedule: list[int], manifest: CacheManifest) -> None:
    """A schedule a check can run: at least one step, each of 1..max_write tokens, within the max
    capacity where a layer is flat (otherwise a good artifact would be reported failing)."""
    if not schedule:
        raise OffgraphError("the schedule is empty: a check runs at least one step")
    bad = next((w for w in schedule if not isinstance(w, int) or not 1 <= w <= manifest.max_write), None)
    if bad is not None:
        raise OffgraphError(f"schedule step of {bad!r} tokens; each step writes 1..max_write={manifest.max_write}")
    if manifest.has_flat and sum(schedule) > manifest.max_capacity:
        raise OffgraphError(
            f"the schedule writes {sum(schedule)} tokens; the artifact holds at most {manifest.max_capacity}"
        )


def _span(rows: list[int]) -> str:
    if not rows:
        return "none"
    if rows == list(range(rows[0], rows[-1] + 1)):
        return f"[{rows[0]}, {rows[-1] + 1})"
    return str(rows)


def assert_artifact_matches(artifact: LoadedProgram | str | Path, bundle: ModelBundle | str, **kwargs) -> CheckReport:
    """Run :func:`check_artifact`; raise :class:`CheckFailed` (an AssertionError) with the report."""
    report = check_artifact(artifact, bundle, **kwargs)
    if not report.passed:
        raise CheckFailed(report.render(), report)
    return report


# -- many sessions, one step (design section 10) -----------------------------------------------


def _batched_plan(
    rng: random.Random, manifest: CacheManifest, active: dict[int, int], prefilling: set[int]
) -> dict[int, int]:
    """Tokens per active session for one step: decode tokens first, then prefill chunks of a few
    tokens, within the step budget (``max_write``) and each session's capacity."""
    budget = manifest.max_write
    plan: dict[int, int] = {}
    order = sorted(active, key=lambda sid: sid in prefilling)  # decode first
    for sid in order:
        room = manifest.max_capacity - active[sid] if manifest.has_flat else budget
        want = rng.randint(2, 9) if sid in prefilling else 1
        n = min(want, budget, room)
        if n >= 1:
            plan[sid] = n
            budget -= n
    return plan


def _rows_before_leaving(manifest: CacheManifest) -> int:
    """The rows a checked session holds before it may leave: enough to have crossed pages (three
    of them) and wrapped every ring layer's slot; a model without ring layers needs the pages only."""
    assert manifest.paging is not None
    rings = [ring_rows(l.window, manifest.max_write) for l in manifest.layers if l.window is not None]
    return max([3 * manifest.paging.page_size, *(r + 1 for r in rings)])


def check_batched(
    artifact: LoadedProgram | str | Path,
    bundle: ModelBundle | str,
    sessions: int = 8,
    steps: int | None = None,
    seed: int = 0,
    cuda_graphs: bool = False,
    pool_pages: int | None = None,
    float32_reference: bool | None = None,
) -> CheckReport:
    """Run ``sessions`` sessions through a batched artifact's :class:`BatchedRunner` with seeded
    random joins and leaves, each step packing decode tokens and prefill chunks of several
    sessions, and check every session's every step against its own eager oracle: its outputs,
    the pool rows the step wrote (exactly its tokens' rows, read through its pages; for a ring its
    slot's rows) and their values. ``steps`` (default: enough for early sessions to wrap every
    ring and cross several pages); ``float32_reference`` as for :func:`check_artifact` (each
    session gets a float32 oracle too). Never raises for a mismatch (see the report)."""
    from offgraph_export.runtime.batched import BatchedRunner

    if isinstance(bundle, str):
        bundle = load_bundle(bundle)
    if isinstance(artifact, (str, Path)):
        artifact = load_artifact(artifact, single_threaded=cuda_graphs)
    manifest = artifact.specs.manifest
    paging = manifest.paging
    if paging is None:
        raise OffgraphError(f"{artifact.path} serves one session per program: check it without --sessions, or export with --max-sessions")
    if isinstance(sessions, bool) or not isinstance(sessions, int) or not 1 <= sessions <= 4096:
        raise OffgraphError(f"sessions={sessions!r} must be an int in [1, 4096]")
    if steps is None:  # time for every session to join, and each wave to wrap its rings before leaving
        rings = [ring_rows(l.window, manifest.max_write) for l in manifest.layers if l.window is not None]
        wave = max(48, 4 * paging.page_size, *(r + 12 for r in rings))
        if manifest.has_flat:
            wave = min(wave, manifest.max_capacity)
        steps = wave * -(-sessions // paging.max_sessions) + 8
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_CHECK_STEPS:
        raise OffgraphError(f"steps={steps!r} must be an int in [1, {MAX_CHECK_STEPS}]")
    _refuse_foreign_quantization(artifact.specs, artifact.path)
    runner = BatchedRunner(artifact, pool_pages=pool_pages, poison=True, cuda_graphs=cuda_graphs)
    report = CheckReport(artifact=str(artifact.path), model=artifact.specs.model, device=str(artifact.device),
                         seed=seed, schedule=[], sessions=0)
    try:
        with _oracle_weights(bundle.model.to(artifact.device), artifact.specs, report):
            _replay_batched(runner, bundle, report, sessions, steps, float32_reference)
    finally:
        for sid in runner.sessions:
            runner.close(sid)
    metrics = runner.metrics()
    if cuda_graphs:
        report.notes.append(f"CUDA graphs: {metrics.graph_captures} captures, {metrics.graph_replays} replays")
    report.passed = not report.problems and all(s.ok for s in report.steps) and bool(report.schedule)
    return report


def _replay_batched(runner, bundle: ModelBundle, report: CheckReport, sessions: int, steps: int,
                    float32_reference: bool | None = None) -> None:
    manifest = runner.manifest
    paging = runner.paging
    device = runner.device
    model = bundle.model.to(device)
    out_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    out_tol = _tolerance(out_dtype, runner.specs)
    storage_tol = _tolerance(getattr(torch, manifest.storage_dtype), runner.specs)
    rng = random.Random(report.seed)
    gen = torch.Generator().manual_seed(report.seed)
    oracles: dict[int, Oracle] = {}
    twin = _float32_twin(model, out_dtype, float32_reference, report)
    references: dict[int, Oracle] = {}  # the sessions' float32 oracles (with a twin)
    tokens: dict[int, torch.Tensor] = {}
    number: dict[int, int] = {}  # runner id -> join number
    prefilling: set[int] = set()
    joined = 0
    longest = manifest.max_capacity if manifest.has_flat else 4 * max(
        ring_rows(l.window, manifest.max_write) for l in manifest.layers if l.window is not None)
    wrapped: set[int] = set()
    mature = _rows_before_leaving(manifest)
    with torch.no_grad():
        for index in range(steps):
            # joins (more early on) and leaves (a session with some history, now and then)
            free = paging.max_sessions - len(runner.sessions)
            if joined < sessions and free and (not runner.sessions or rng.random() < 0.5):
                sid = runner.open()
                number[sid] = joined
                joined += 1
                oracles[sid] = bundle.oracle(manifest)
                if twin is not None:
                    references[sid] = bundle.oracle(manifest)
                tokens[sid] = torch.randint(0, bundle.vocab_size, (1, longest), generator=gen)
                prefilling.add(sid)
            odds = 0.25 if joined < sessions else 0.05  # leave sooner while sessions wait for a slot
            full = manifest.max_capacity if manifest.has_flat else None
            leaving = [sid for sid in runner.sessions
                       if runner.length(sid) == full or (runner.length(sid) > mature and rng.random() < odds)]
            for sid in leaving:
                runner.close(sid)
            if not runner.sessions:
                report.notes.append(f"every session had joined and left after {index} steps")
                break
            active = {sid: runner.length(sid) for sid in runner.sessions}
            plan = _batched_plan(rng, manifest, active, prefilling)
            feeds = {sid: tokens[sid][0, active[sid] : active[sid] + n].tolist() for sid, n in plan.items()}
            report.schedule.append(sum(plan.values()))
            before = [t.clone() for t in runner.storage]
            pages_before = {sid: len(runner.pages(sid)) for sid in plan}
            try:
                outputs = runner.step(feeds)
            except Exception as exc:  # refused or failed: report, stop the replay
                report.problems.append(f"step {index} ({len(plan)} sessions, {sum(plan.values())} tokens) raised: {first_line(exc)}")
                break
            after = runner.storage
            expected_rows = _batched_rows(runner, plan, active)
            for sid, n in plan.items():
                start = active[sid]
                step = StepReport(index=index, kind="prefill" if sid in prefilling else "decode", start=start, width=n,
                                  width_from_spec=n, method=runner.last_method or "",
                                  session=number[sid], step_tokens=sum(plan.values()))
                report.steps.append(step)
                inputs = bundle.make_inputs(tokens[sid][:, start : start + n].to(device), start)
                expected = oracles[sid].step(inputs)
                reference = _reference_step(twin, references.get(sid), inputs)
                _compare_outputs(step, outputs[sid][0], expected[0], out_tol, reference)
                _compare_paged_rows(step, runner, sid, list(range(start, start + n)), before, after, oracles[sid], storage_tol,
                                    report.notes, references.get(sid))
                if len(runner.pages(sid)) > pages_before[sid] and pages_before[sid]:
                    report.page_crossings += 1
                for layer in manifest.layers:
                    if layer.window is not None and start + n > ring_rows(layer.window, manifest.max_write):
                        wrapped.add(layer.layer_id)
            prefilling -= {sid for sid in plan if rng.random() < 0.5}
            _compare_unwritten(report, index, runner, before, after, expected_rows)
    report.sessions = joined
    for layer in manifest.layers:
        if layer.window is not None:
            report.ring_wraps[str(layer.layer_id)] = layer.layer_id in wrapped
    if manifest.has_flat and report.page_crossings < 2:
        report.notes.append(f"sessions crossed {report.page_crossings} page boundaries (wanted >= 2)")
    if joined < sessions:
        report.notes.append(f"{joined} of {sessions} sessions joined within {steps} steps")
    ran = runner.metrics().method_steps
    if len(ran) > 1:
        report.notes.append("methods: " + ", ".join(f"{m} ran {n} steps" for m, n in sorted(ran.items())))


def _pool_rows(tensor: torch.Tensor, flat: bool) -> torch.Tensor:
    """A pool as ``[pages * page_size, Hkv, D]``; rings as ``[slots * rows, Hkv, D]``."""
    if flat:
        return tensor.reshape(-1, tensor.shape[2], tensor.shape[3])
    return tensor.transpose(1, 2).reshape(-1, tensor.shape[1], tensor.shape[3])


def _row_of(runner, sid: int, position: int, layer, rows: int) -> int:
    """Where ``position`` of session ``sid`` lives in :func:`_pool_rows`'s view of a layer."""
    if layer.window is None:
        return paged_row(runner.pages(sid), position, runner.paging.page_size)
    return runner.slot(sid) * rows + storage_row(position, rows)


def _batched_rows(runner, plan: dict[int, int], active: dict[int, int]) -> dict[int, set[int]]:
    """Per storage input, the rows the step's real tokens write."""
    manifest = runner.manifest
    out: dict[int, set[int]] = {}
    for i, storage in enumerate(manifest.storage_inputs()):
        layer, _ = manifest.owner(storage)
        rows = manifest.rows(layer, manifest.max_capacity)
        out[i] = {_row_of(runner, sid, p, layer, rows) for sid, n in plan.items() for p in range(active[sid], active[sid] + n)}
    return out


def _compare_unwritten(report: CheckReport, index: int, runner, before, after, expected: dict[int, set[int]]) -> None:
    """Outside the step's rows only the scratch page (slot) may change: padding tokens write there."""
    manifest = runner.manifest
    for i, storage in enumerate(manifest.storage_inputs()):
        layer, _ = manifest.owner(storage)
        flat = layer.window is None
        old, new = _pool_rows(before[i], flat), _pool_rows(after[i], flat)
        scratch = runner.paging.page_size if flat else manifest.rows(layer, manifest.max_capacity)
        same = (old == new) | (torch.isnan(old) & torch.isnan(new))
        changed = set((~same).flatten(1).any(dim=1).nonzero().flatten().tolist())
        stray = sorted(r for r in changed - expected[i] if r >= scratch)
        missing = sorted(expected[i] - changed) if flat else []  # see _rows_differ
        if stray:
            report.problems.append(f"step {index}: {storage.name}: rows {_span(stray[:8])} changed that no token of the step owns")
        if missing:
            report.problems.append(f"step {index}: {storage.name}: rows {_span(missing[:8])} of the step's tokens were not written")


def _compare_paged_rows(step: StepReport, runner, sid: int, positions: list[int], before, after, oracle: Oracle,
                        tolerance: tuple[float, float], notes: list[str], reference: Oracle | None = None) -> None:
    """The rows of this session's tokens hold the oracle's K/V (those the oracle still holds;
    ``reference``: the session's float32 oracle); layers whose eager cache holds another form are
    left out, once noted in ``notes``."""
    manifest = runner.manifest
    for i, storage in enumerate(manifest.storage_inputs()):
        layer, which = manifest.owner(storage)
        rows = manifest.rows(layer, manifest.max_capacity)
        view = _pool_rows(after[i], layer.window is None)
        held = oracle.held(layer.layer_id)
        if not _rows_comparable(oracle, held, layer):
            note = _form_note(layer, _other_form(held, layer))  # type: ignore[arg-type]
            if note not in notes:
                notes.append(note)
            continue  # its cache holds another form
        kept = set(held[0]) if held else set()
        common = [p for p in positions if p in kept]
        if not common:
            step.problems.append(f"{storage.name}: the oracle holds none of positions {_span(positions)}")
            continue
        want = _held_rows(held, which, common, token_major=True)
        got = view[[_row_of(runner, sid, p, layer, rows) for p in common]].float().to(want.device)
        _compare_stored(step, storage.name, got, want, tolerance,
                        _reference_rows(reference, layer.layer_id, which, common, token_major=True))
