"""Export with or without the functionalize pass (experiment): python export_variant.py skip|keep (skip: functionalize does nothing, what `lowering_traces` now does for a float program; keep: the pass as before) OUT.pt2 MODEL"""
import sys, time
variant, out, model = sys.argv[1:4]
import offgraph_export.pipeline as pipeline
from offgraph_export.passes.result import PassResult
if variant == "skip":
    pipeline.functionalize = lambda ep: PassResult(ep, modified=False, produced=None)
from offgraph_export.cli.main import cli
t = time.perf_counter()
try:
    try:
        cli(["export", model, "-o", out, "--dtype", "bfloat16", "--max-capacity", "512", "--json"])
    except SystemExit as e:
        print("exit", e.code, file=sys.stderr)
finally:
    print(f"variant {variant} wall {time.perf_counter() - t:.1f}s", file=sys.stderr)
