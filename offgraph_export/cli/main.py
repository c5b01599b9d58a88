"""The ``offgraph-export`` command line: export, inspect, check, run."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import click

from offgraph_export.errors import OffgraphError

__all__ = ["cli"]


def _say(message: str) -> None:
    click.echo(message, err=True)


def _fail(exc: Exception, code: int = 2) -> None:
    _say(f"error: {exc}")
    sys.exit(code)


class _Pairs(click.ParamType):
    name = "LAYER=WINDOW"

    def convert(self, value, param, ctx):
        layer, sep, window = str(value).partition("=")
        if not sep or not layer.isdigit() or not window.isdigit():
            self.fail(f"{value!r} must look like LAYER=WINDOW, e.g. 1=16", param, ctx)
        return int(layer), int(window)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="offgraph-export")
def cli() -> None:
    """Export LLM decoders whose KV cache lives off the graph.

    \b
    export   trace a model, strip its KV op, lower it with AOTInductor to a .pt2
    inspect  show an artifact's specs, manifest and inputs without loading its code
    check    replay a session through the artifact and the eager model (CI lowering check)
    run      greedy generation from an artifact with a per-session cache
    """


@cli.command()
@click.argument("model_factory")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Path of the .pt2 to write.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--max-capacity", type=int, help="Hard bound of tokens per session (default: the factory's).")
@click.option("--initial-capacity", type=int, help="Flat rows allocated when a session opens.")
@click.option("--max-write", type=int, help="Most tokens one step may write (the compiled width range).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), help="Cast the model and store the cache in this dtype.")
@click.option("--ring", "rings", type=_Pairs(), multiple=True, help="Make LAYER a sliding-window layer: LAYER=WINDOW (repeatable).")
@click.option("--all-flat", is_flag=True, help="Ignore the factory's ring layers: every layer keeps all history.")
@click.option("--step-impl", type=click.Choice(["portable", "triton"]), help="Lowered step implementation (default: triton on cuda, portable on cpu).")
@click.option("-a", "--arg", "factory_args", multiple=True, metavar="NAME=VALUE", help="Keyword argument for the model factory (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
def export(model_factory, output, device, max_capacity, initial_capacity, max_write, dtype, rings, all_flat, step_impl, factory_args, as_json):
    """Export MODEL_FACTORY (FILE.py:FUNCTION or package.module:FUNCTION) to a .pt2 artifact."""
    from offgraph_export.frontends import canonical_reference, load_bundle
    from offgraph_export.frontends.factory import parse_factory_args
    from offgraph_export.models import cast_bundle
    from offgraph_export.pipeline import export_and_lower

    try:
        args = parse_factory_args(factory_args)
        _say(f"building {model_factory}")
        bundle = cast_bundle(load_bundle(model_factory, **args), dtype)
        config = bundle.cache_config.with_overrides(
            max_capacity=max_capacity, initial_capacity=initial_capacity, max_write=max_write,
            rings=rings, all_flat=all_flat,
        )
        started = time.perf_counter()
        path, program, timings = export_and_lower(
            replace(bundle, cache_config=config), output, device=device, step_impl=step_impl,
            progress=lambda m: _say(f"[{time.perf_counter() - started:6.1f}s] {m}"),
            model=canonical_reference(model_factory), model_args=args, model_dtype=dtype,
        )
    except OffgraphError as exc:
        _fail(exc)
    size = path.stat().st_size
    summary = {
        "artifact": str(path), "device": device, "step_impl": program.step_impl,
        "step_width": program.step_width.format(), "layers": len(program.manifest.layers),
        "bytes": size, **{k: round(v, 3) for k, v in timings.items()},
    }
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _say(
            f"wrote {path} ({size / 1e6:.1f} MB): step width {summary['step_width']}, "
            f"{summary['layers']} layers; export {timings['export_s']:.1f}s, passes "
            f"{timings['passes_s']:.1f}s, compile {timings['compile_s']:.1f}s"
        )


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the specs as JSON.")
def inspect(artifact, as_json):
    """Show ARTIFACT's step width, manifest and inputs (reads the archive; loads no code)."""
    from offgraph_export.specs.artifact import archive_entries, read_artifact_specs

    try:
        specs = read_artifact_specs(artifact)
        entries = archive_entries(artifact)
    except OffgraphError as exc:
        _fail(exc)
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
        "",
        "inputs",
    ]
    for i, inp in enumerate(specs.inputs):
        out.append(f"  {i:<3d} {inp.name:<16s} {inp.dtype:<9s} {inp.shape}")
    for s in m.storage_inputs():
        out.append(f"  {s.index:<3d} {s.name:<16s} {m.storage_dtype:<9s} (storage)")
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
    click.echo("\n".join(out))


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--model", "model_factory", help="Model factory of the eager oracle (default: the one recorded at export).")
@click.option("--steps", default=16, show_default=True, help="Decode steps after the prefill.")
@click.option("--prefill-chunks", default=3, show_default=True, help="Chunks the prefill is split into.")
@click.option("--seed", default=0, show_default=True)
@click.option("-a", "--arg", "factory_args", multiple=True, metavar="NAME=VALUE", help="Factory argument (default: those recorded at export).")
@click.option("--cuda-graphs", is_flag=True, help="Replay decode steps as CUDA graphs (cuda artifacts).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(artifact, model_factory, steps, prefill_chunks, seed, factory_args, cuda_graphs, as_json):
    """Check ARTIFACT's compiled steps against its spec and the eager model.

    Exits 0 when every step matches, 1 when any check fails, 2 when the check cannot run."""
    from offgraph_export.check import check_artifact
    from offgraph_export.frontends import load_bundle
    from offgraph_export.frontends.factory import parse_factory_args
    from offgraph_export.models import cast_bundle
    from offgraph_export.specs.artifact import read_artifact_specs

    try:
        specs = read_artifact_specs(artifact)
        factory = model_factory or specs.model
        if not factory:
            raise OffgraphError(f"{artifact} records no model factory; pass --model FILE.py:FUNCTION")
        args = parse_factory_args(factory_args) if factory_args else dict(specs.model_args)
        bundle = cast_bundle(load_bundle(factory, **args), specs.model_dtype)
        _say(f"checking {artifact} against {factory} on {specs.device}")
        report = check_artifact(artifact, bundle, decode_steps=steps, prefill_chunks=prefill_chunks, seed=seed,
                                cuda_graphs=cuda_graphs)
        report.model = factory
    except OffgraphError as exc:
        _fail(exc)
    click.echo(report.model_dump_json(indent=2) if as_json else report.render())
    sys.exit(0 if report.passed else 1)


@cli.command()
@click.argument("artifact", type=click.Path(dir_okay=False))
@click.option("--prompt", help="Text prompt (encoded by the model factory's tokenizer).")
@click.option("--tokens", help="Comma-separated token ids instead of a prompt.")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--model", "model_factory", help="Model factory for the tokenizer and input builder (default: recorded).")
@click.option("--cuda-graphs", is_flag=True, help="Replay decode steps as CUDA graphs (cuda artifacts).")
@click.option("--json", "as_json", is_flag=True, help="Print tokens, text and metrics as JSON.")
def run(artifact, prompt, tokens, max_new_tokens, model_factory, cuda_graphs, as_json):
    """Greedy generation from ARTIFACT with a session-owned cache."""
    from offgraph_export.generate import generate
    from offgraph_export.frontends import load_bundle
    from offgraph_export.runtime.artifact import Artifact

    if (prompt is None) == (tokens is None):
        _fail(OffgraphError("give exactly one of --prompt or --tokens"))
    try:
        loaded = Artifact.load(artifact, single_threaded=cuda_graphs)
        specs = loaded.specs
        factory = model_factory or specs.model
        if not factory:
            raise OffgraphError(f"{artifact} records no model factory; pass --model FILE.py:FUNCTION")
        bundle = load_bundle(factory, **specs.model_args)
        if prompt is not None:
            if bundle.encode is None:
                raise OffgraphError(f"{factory} has no tokenizer; use --tokens")
            ids = bundle.encode(prompt)
        else:
            try:
                ids = [int(t) for t in tokens.split(",") if t.strip()]
            except ValueError:
                raise OffgraphError(f"--tokens {tokens!r} must be comma-separated integers") from None
        session = loaded.new_session(cuda_graphs=cuda_graphs)
        with click.progressbar(length=max_new_tokens, label="generating", file=sys.stderr) as bar:
            result = generate(session, bundle.make_inputs, ids, max_new_tokens, on_token=lambda _: bar.update(1))
    except OffgraphError as exc:
        _fail(exc)
    text = bundle.decode(result.new_tokens) if bundle.decode else None
    metrics = session.metrics()
    if as_json:
        click.echo(json.dumps({"prompt_tokens": ids, "new_tokens": result.new_tokens, "text": text,
                               "metrics": metrics.model_dump(), "decode_ms_median": result.decode_ms_median}))
        return
    click.echo(text if text is not None else " ".join(map(str, result.new_tokens)))
    _say(
        f"session: committed_length {metrics.committed_length}, capacity {metrics.capacity}, "
        f"{metrics.growth_count} growths, {metrics.allocated_bytes / 1e6:.2f} MB, "
        f"{metrics.graph_captures} graph captures; decode median {result.decode_ms_median:.2f} ms/token"
    )


if __name__ == "__main__":
    cli()
