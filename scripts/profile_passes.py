"""Where an export's pass time goes, pass by pass, without compiling: the model traced and run
through ``run_passes`` with the options of a cuda export that run on the cpu (fused projections,
the decode method; the GEMV and rotary folds need cuda tensors and are left out), float and
``--quantize int8``. For issue 27 (a large model's passes take minutes).

    python scripts/profile_passes.py hf:benchmarks/configs/llama-3.2-1b --dtype bfloat16 --out passes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace

import torch

from offgraph_export.frontends import load_bundle
from offgraph_export.models import cast_bundle
from offgraph_export.pipeline import _fit_width, export_model, run_passes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-capacity", type=int, default=8384)
    parser.add_argument("--max-write", type=int, default=512)
    parser.add_argument("--quantize", nargs="*", default=["none", "int8"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.perf_counter()
    bundle = cast_bundle(load_bundle(args.model), args.dtype)
    config = bundle.cache_config.with_overrides(max_capacity=args.max_capacity, max_write=args.max_write)
    bundle = replace(bundle, cache_config=config)
    bundle.model.requires_grad_(False)
    runs = {"model": args.model, "dtype": args.dtype, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "build_s": time.perf_counter() - t0, "runs": {}}
    print(f"built in {runs['build_s']:.1f}s", flush=True)
    inputs = _fit_width(bundle.example_inputs, bundle.token_dims, config.max_write, "cpu")
    for quantize in args.quantize:
        t0 = time.perf_counter()
        ep = export_model(bundle.model, inputs, bundle.token_dims, config.max_write)
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        program = run_passes(ep, inputs, config, "portable", fuse=True, decode_method=True, quantize=quantize,
                             group_size=None, progress=lambda m: print(m, flush=True))
        passes_s = time.perf_counter() - t0
        runs["runs"][quantize] = {"export_s": export_s, "passes_s": passes_s, "pass_seconds": program.pass_seconds}
        print(f"{quantize}: export {export_s:.1f}s, passes {passes_s:.1f}s", flush=True)
        del program, ep
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
