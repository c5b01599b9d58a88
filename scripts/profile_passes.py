"""Where an export's pass time goes, pass by pass, without compiling: the model traced and run
through ``run_passes`` with the options of a cuda export that run on the cpu (fused projections,
the decode method; the GEMV and rotary folds need cuda tensors and are left out), float and
``--quantize int8``. For issue 27 (a large model's passes take minutes). ``--lowering-traces``: as
``export --format pt2`` runs them (AOTInductor traces again, so ``functionalize`` decomposes only
the dequantized weights, spliced in place); it then also times, on the same stripped program, the
whole-program re-trace (``run_decompositions``) that pass ran before session 29, beside it.

    python scripts/profile_passes.py hf:benchmarks/configs/llama-3.2-1b --dtype bfloat16 --out passes.json
    python scripts/profile_passes.py hf:benchmarks/configs/llama-3.2-1b --quantize int8 int4 --lowering-traces --out passes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace

import torch

from offgraph_export.compat import decompose
from offgraph_export.frontends import load_bundle
from offgraph_export.ops.quantized import DECOMPOSITIONS
from offgraph_export.models import cast_bundle
from offgraph_export.pipeline import _fit_width, export_model, run_passes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-capacity", type=int, default=8384)
    parser.add_argument("--max-write", type=int, default=512)
    parser.add_argument("--quantize", nargs="*", default=["none", "int8"])
    parser.add_argument("--group-size", type=int, default=128, help="int4's group")
    parser.add_argument("--lowering-traces", action="store_true", help="the passes as a .pt2 export runs them")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.perf_counter()
    bundle = cast_bundle(load_bundle(args.model), args.dtype)
    config = bundle.cache_config.with_overrides(max_capacity=args.max_capacity, max_write=args.max_write)
    bundle = replace(bundle, cache_config=config)
    bundle.model.requires_grad_(False)
    runs = {"command": "python scripts/profile_passes.py " + " ".join(sys.argv[1:]), "model": args.model, "dtype": args.dtype, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "build_s": time.perf_counter() - t0, "runs": {}}
    print(f"built in {runs['build_s']:.1f}s", flush=True)
    inputs = _fit_width(bundle.example_inputs, bundle.token_dims, config.max_write, "cpu")
    for quantize in args.quantize:
        t0 = time.perf_counter()
        ep = export_model(bundle.model, inputs, bundle.token_dims, config.max_write)
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        program = run_passes(ep, inputs, config, "portable", fuse=True, decode_method=True, quantize=quantize,
                             group_size=args.group_size if quantize == "int4" else None,
                             progress=lambda m: print(m, flush=True), lowering_traces=args.lowering_traces)
        passes_s = time.perf_counter() - t0
        runs["runs"][quantize] = {"export_s": export_s, "passes_s": passes_s, "pass_seconds": program.pass_seconds,
                                  "lowering_traces": args.lowering_traces}
        print(f"{quantize}: export {export_s:.1f}s, passes {passes_s:.1f}s", flush=True)
        if args.lowering_traces and quantize != "none":
            t0 = time.perf_counter()
            decompose(program.pass_results["strip_kv_cache"].program, DECOMPOSITIONS)
            runs["runs"][quantize]["functionalize_by_retrace_s"] = retrace_s = time.perf_counter() - t0
            print(f"{quantize}: functionalize {program.pass_seconds['functionalize']:.1f}s spliced, {retrace_s:.1f}s re-traced", flush=True)
        del program, ep
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
